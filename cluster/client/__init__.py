"""Clients of a running cluster, over gRPC (``router/pb``):

    connection.py  channels with TLS / mTLS and API keys (the --url flags)
    generate.py    ``generate --url``: stream one request's text
    chat.py        ``chat``: multi-turn on the terminal (a cluster, or the offline engine)
    status.py      ``status``: table of the live replicas
    table.py       plain-text tables and percentiles (status, benchmarks)
"""

"""Stubs generated from ``proto/prefixserve/v1/generation.proto``.

Do not edit: run ``python scripts/gen_proto.py`` after changing the .proto
(``tests/unit/test_proto_stubs.py`` fails until you do).
"""

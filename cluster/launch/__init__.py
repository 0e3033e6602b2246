"""The local launcher behind ``prefixserve up``: Ray on loopback, a
``redis-server`` for the prefix directory, the Serve application and the
front ends, started and stopped together.

    local.py         LocalCluster
    redis_server.py  RedisServer: a redis-server on a free loopback port that
                     dies with its owner
"""

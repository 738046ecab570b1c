"""Test support shipped with the library: real servers and multi-rank runs for tests and benches.

Modules: ``multiprocess`` (spawn N gloo ranks on CPU), ``servers`` (start real PostgreSQL and
Redis servers on 127.0.0.1 and free ports).
"""

"""The client side: what an application uses to submit runs, read them and wait for them.

client.py    Client, on psycopg's synchronous connections (and `cyclone.submit`)
aclient.py   AsyncClient, on psycopg's AsyncConnection
calls.py     what each call checks, sends and reads back, written once for both clients
waiting.py   waits for runs to end: one listening connection per client, polling as fallback
bridge.py    the engine's synchronous operations (cancel, signal...) run from AsyncClient

`cyclone.Client`, `cyclone.AsyncClient` and `cyclone.submit` are the public names; this package
stands on the engine and the core modules, like them (tests/unit/test_import_direction.py).
"""

"""Imported first by `recovery-daemon`: nats-py without its websocket transport. nats-py imports aiohttp, where it is
installed, for `ws://` and `wss://` servers, and aiohttp builds TLS contexts as it loads: about 0.11 s of every
daemon start, a restart after a crash included, for a transport the daemon does not use (its servers are `nats://`
or `tls://`, and its configuration refuses a websocket URL). Anything else in the process imports aiohttp as usual
afterwards."""

import sys

if "nats.aio.transport" not in sys.modules and "aiohttp" not in sys.modules:
    sys.modules["aiohttp"] = None  # type: ignore[assignment]  # nats-py's `import aiohttp` fails: no websockets
    try:
        import nats.aio.transport  # noqa: F401
    finally:
        del sys.modules["aiohttp"]

"""Shared by the SDK scripts: each checked SDK call prints `ok <call>`, so the test log
lists every call tried; a failed check raises with what was seen."""

import os
import sys
import time

from e2b import Sandbox

TEMPLATE = os.environ.get("AENV_SDK_TEMPLATE", "base")
# The API as the SDK reaches it: E2B_API_URL, or in domain mode (only E2B_DOMAIN set)
# the SDK's default https://api.<domain>.
API = os.environ.get("E2B_API_URL") or "https://api." + os.environ["E2B_DOMAIN"]


def ok(call, condition=True, seen=None):
    if not condition:
        raise AssertionError(f"{call}: unexpected {seen!r}")
    print(f"ok {call}", flush=True)


def raises(call, exc_type, fn):
    try:
        fn()
    except exc_type as e:
        print(f"ok {call} -> {type(e).__name__}", flush=True)
        return e
    except Exception as e:  # noqa: BLE001 - the wrong exception is the failure
        raise AssertionError(f"{call}: raised {type(e).__name__}: {e}, not {exc_type.__name__}")
    raise AssertionError(f"{call}: raised nothing, not {exc_type.__name__}")


def create(**kwargs):
    kwargs.setdefault("timeout", 600)
    return Sandbox.create(TEMPLATE, **kwargs)


def main(body):
    started = time.monotonic()
    body()
    print(f"done {os.path.basename(sys.argv[0])} in {time.monotonic() - started:.1f}s", flush=True)

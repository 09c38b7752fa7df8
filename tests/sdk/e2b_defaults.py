"""E2B's defaults and the create/list details through the python SDK (issue 20 items 1, 6):
a bare Sandbox.create lives 300 s and is killed on timeout, `lifecycle` as get_info reads
it, list `order` / `started_after` / `template`, a retried create with the same
`idempotency_key`, and the 4xx answers for bad lifecycle values, keys and list filters."""

import datetime
import os
import time

import httpx

from e2b import Sandbox, SandboxException, SandboxQuery

from check import API, TEMPLATE, main, ok, raises

HEADERS = {"X-API-Key": os.environ["E2B_API_KEY"]}


def post(path, body, headers=None):
    return httpx.post(API + path, json=body, headers={**HEADERS, **(headers or {})}, timeout=120)


def body():
    before = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=1)
    bare = Sandbox.create(TEMPLATE, metadata={"suite": "defaults"})
    info = bare.get_info()
    ttl = (info.end_at - info.started_at).total_seconds()
    ok("bare Sandbox.create() lives 300 s", 295 <= ttl <= 305, ttl)
    ok(
        "bare Sandbox.create() is killed on timeout, no auto-resume",
        info.lifecycle == {"on_timeout": "kill", "auto_resume": False},
        info.lifecycle,
    )

    paused_kind = Sandbox.create(
        TEMPLATE,
        timeout=600,
        metadata={"suite": "defaults"},
        lifecycle={"on_timeout": "pause", "auto_resume": True},
    )
    got = paused_kind.get_info().lifecycle
    ok("lifecycle pause + auto_resume in get_info", got == {"on_timeout": "pause", "auto_resume": True}, got)

    # order: by start time, across the whole result set.
    mine = SandboxQuery(metadata={"suite": "defaults"})
    desc = [s.sandbox_id for s in Sandbox.list(query=mine).next_items()]
    asc = [s.sandbox_id for s in Sandbox.list(query=mine, order="asc").next_items()]
    ok("Sandbox.list() newest first", desc == [paused_kind.sandbox_id, bare.sandbox_id], desc)
    ok("Sandbox.list(order='asc') oldest first", asc == [bare.sandbox_id, paused_kind.sandbox_id], asc)
    page = Sandbox.list(query=mine, order="asc", limit=1)
    first = [s.sandbox_id for s in page.next_items()]
    second = [s.sandbox_id for s in page.next_items()]
    ok("Sandbox.list(order='asc', limit=1) pages in order", first + second == asc, (first, second))

    # started_after: a time between the two creates.
    between = paused_kind.get_info().started_at - datetime.timedelta(milliseconds=1)
    later = Sandbox.list(query=SandboxQuery(metadata={"suite": "defaults"}, started_after=between)).next_items()
    ok("Sandbox.list(started_after=)", [s.sandbox_id for s in later] == [paused_kind.sandbox_id], later)
    since = Sandbox.list(query=SandboxQuery(metadata={"suite": "defaults"}, started_after=before)).next_items()
    ok("Sandbox.list(started_after=before both)", len(since) == 2, since)
    r = httpx.get(API + "/v2/sandboxes", params={"startedBefore": between.isoformat()}, headers=HEADERS)
    ok("GET /v2/sandboxes?startedBefore=", [s["sandboxID"] for s in r.json()] == [bare.sandbox_id], r.text)

    # template: by id or name.
    by_name = Sandbox.list(query=SandboxQuery(metadata={"suite": "defaults"}, template=TEMPLATE)).next_items()
    ok("Sandbox.list(template=name)", len(by_name) == 2, by_name)
    other = Sandbox.list(query=SandboxQuery(template="no-such-template")).next_items()
    ok("Sandbox.list(template=other) is empty", other == [], other)

    # Idempotency-Key: a retry gets the first call's sandbox, a different body 409.
    key = f"retry-{os.getpid()}-{int(time.time())}"
    one = Sandbox.create(TEMPLATE, timeout=600, metadata={"suite": "idem"}, idempotency_key=key)
    two = Sandbox.create(TEMPLATE, timeout=600, metadata={"suite": "idem"}, idempotency_key=key)
    ok("a retried create with the same idempotency_key", one.sandbox_id == two.sandbox_id, (one, two))
    ok("the retry can use the sandbox", two.commands.run("echo same").stdout == "same\n")
    made = Sandbox.list(query=SandboxQuery(metadata={"suite": "idem"})).next_items()
    ok("only one sandbox was made", len(made) == 1, made)
    raises(
        "the same idempotency_key with another body",
        SandboxException,
        lambda: Sandbox.create(TEMPLATE, timeout=601, metadata={"suite": "idem"}, idempotency_key=key),
    )
    r = post("/v2/sandboxes", {"templateID": TEMPLATE, "timeout": 601, "metadata": {"suite": "idem"}}, {"Idempotency-Key": key})
    ok("... is 409", r.status_code == 409 and "Idempotency-Key" in r.json()["message"], r.text)
    r = post("/v2/sandboxes", {"templateID": TEMPLATE}, {"Idempotency-Key": "k" * 256})
    ok("an Idempotency-Key over 255 characters is 400", r.status_code == 400 and "Idempotency-Key" in r.text, r.text)

    # Bad lifecycle values and filters name the field.
    for bad, field in [
        ({"autoPause": "maybe"}, "autoPause"),
        ({"autoResume": True}, "autoResume"),
        ({"autoResume": {"enabled": "yes"}}, "autoResume.enabled"),
        ({"autoPause": False, "autoResume": {"enabled": True}}, "autoResume.enabled"),
        ({"autoPause": True, "autoPauseMemory": False, "autoResume": {"enabled": True}}, "autoPauseMemory"),
        ({"autoPauseMemory": 3}, "autoPauseMemory"),
    ]:
        r = post("/v2/sandboxes", {"templateID": TEMPLATE, **bad})
        ok(f"create with {bad} is 4xx naming {field}", r.status_code in (400, 422) and field in r.json()["message"], r.text)
    for q, field in [({"order": "up"}, "order"), ({"startedAfter": "yesterday"}, "startedAfter")]:
        r = httpx.get(API + "/v2/sandboxes", params=q, headers=HEADERS)
        ok(f"GET /v2/sandboxes?{q} is 400", r.status_code == 400 and field in r.text, r.text)

    for s in (bare, paused_kind, one):
        s.kill()
    ok("killed")


main(body)

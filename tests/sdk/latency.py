"""Sandbox.create -> first commands.run, five times; prints each and the median (ms)."""

import statistics
import time

from check import create, main, ok


def body():
    samples = []
    for _ in range(5):
        started = time.monotonic()
        sbx = create()
        r = sbx.commands.run("echo ready")
        samples.append((time.monotonic() - started) * 1000)
        ok("create -> commands.run", r.stdout == "ready\n", r.stdout)
        sbx.kill()
    print("latency_ms " + " ".join(f"{s:.0f}" for s in samples), flush=True)
    print(f"latency_median_ms {statistics.median(samples):.0f}", flush=True)


main(body)

"""Schemathesis hooks for tests/e2e_fuzz.rs.

Every generated image reference is replaced by a local OCI layout that does not exist,
so that creates and template builds fail fast with 400 instead of reaching out to a
registry (no network in CI) or cold-booting VMs (2 cores). Everything else is sent as
generated.
"""

import schemathesis

MISSING_IMAGE = "oci:/nonexistent/agentenv-fuzz"


@schemathesis.hook
def map_case(context, case):
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("image"), str):
        body["image"] = MISSING_IMAGE
    return case

"""Several nodes behind one endpoint, through the python SDK as a user would drive it:
creates from one template (AENV_SDK_TEMPLATE, built once through the same endpoint) land
on more than one node, and on each node commands, files and a PTY work; one list shows
every sandbox; pause and resume work on a sandbox whichever node answers. Prints
`sandbox <id> <node>` for each sandbox it keeps running (AENV_CLUSTER_KEEP of them) so
the test can go on with them, and kills the rest."""

import os

from e2b import PtySize, Sandbox, SandboxQuery, SandboxState

from check import create, main, ok

CREATES = int(os.environ.get("AENV_CLUSTER_CREATES", "12"))
KEEP = int(os.environ.get("AENV_CLUSTER_KEEP", "0"))


def works(sbx, node):
    out = sbx.commands.run(f"echo on-{node}; cat /etc/os-release | head -1")
    ok(f"commands.run on {node}", out.stdout.startswith(f"on-{node}\n") and out.exit_code == 0, out)
    sbx.files.write("/tmp/cluster.txt", f"written via the endpoint to {node}\n")
    ok(f"files.read on {node}", sbx.files.read("/tmp/cluster.txt") == f"written via the endpoint to {node}\n")
    seen = bytearray()
    pty = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.send_stdin(pty.pid, b"echo pty-$((40+2)); exit\n")
    result = pty.wait(on_pty=lambda data: seen.extend(data))
    ok(f"pty on {node}", "pty-42" in seen.decode(errors="replace") and result.exit_code == 0, seen)


def body():
    tag = {"suite": "cluster"}
    made = []
    for _ in range(CREATES):
        made.append(create(metadata=tag, timeout=600))
    # The id ends with its node's name (docs/cluster.md, "Ids").
    by_node = {}
    for sbx in made:
        by_node.setdefault(sbx.sandbox_id.rsplit("-", 1)[1], []).append(sbx)
    ok(f"{CREATES} creates land on more than one node", len(by_node) > 1, sorted(by_node))
    for node, sandboxes in sorted(by_node.items()):
        works(sandboxes[0], node)

    listed = {s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata=tag), limit=100).next_items()}
    ok("Sandbox.list shows every node's sandboxes", listed == {s.sandbox_id for s in made}, (listed, by_node))

    # Pause and resume one sandbox of each node: the request lands on any node.
    for node, sandboxes in sorted(by_node.items()):
        sbx = sandboxes[-1]
        sbx.files.write("/tmp/kept.txt", "kept across the pause")
        sbx.pause()
        ok(f"pause on {node}")
        info = Sandbox.get_info(sbx.sandbox_id)
        ok(f"paused on {node}", info.state == SandboxState.PAUSED, info.state)
        back = Sandbox.connect(sbx.sandbox_id, timeout=600)
        ok(f"resume on {node}", back.files.read("/tmp/kept.txt") == "kept across the pause")

    keep = []
    for node, sandboxes in sorted(by_node.items()):
        if len(keep) < KEEP:
            keep.append(sandboxes[0])
    for sbx in made:
        if sbx in keep:
            print(f"sandbox {sbx.sandbox_id} {sbx.sandbox_id.rsplit('-', 1)[1]}", flush=True)
        else:
            ok("kill", sbx.kill())


main(body)

"""E2B templates as code with the python SDK: Template().from_image(...) with ENV, RUN,
USER, WORKDIR, COPY (a directory and a file, owner and mode) and a start command, built
with Template.build; sandboxes from it; a rebuild that changes only the last step (the
earlier steps come from the cache); a failing RUN; build_in_background and
get_build_status; aliases, tags, delete. AENV_TEST_IMAGE names the image.
AENV_TEST_READY=sdk makes the start commands wait with the SDK's own ready commands
(wait_for_port, then wait_for_url on the rebuild, wait_for_process in the background
build), which need ss, curl and pgrep in the image; otherwise a marker file."""

import os
import sys
import tempfile
import time

from check import main, ok, raises
from e2b import (
    BuildException,
    Sandbox,
    Template,
    wait_for_file,
    wait_for_port,
    wait_for_process,
    wait_for_url,
)

IMAGE = os.environ["AENV_TEST_IMAGE"]
ALIAS = os.environ.get("AENV_TEST_ALIAS", "sdk-app")
# The image's HTTP server for the start command: busybox httpd, else python's.
SERVE = os.environ.get(
    "AENV_TEST_SERVE", "mkdir -p /tmp/www && echo served > /tmp/www/index.html && httpd -f -p 8080 -h /tmp/www"
)
FETCH = os.environ.get("AENV_TEST_FETCH", "wget -q -O- http://127.0.0.1:8080/")
SDK_READY = os.environ.get("AENV_TEST_READY") == "sdk"


def start(template, rebuild=False):
    """The start command serving on 8080 and how the build knows it is ready."""
    if SDK_READY:
        ready = wait_for_url("http://127.0.0.1:8080/") if rebuild else wait_for_port(8080)
        return template.set_start_cmd(SERVE, ready)
    return template.set_start_cmd(f"{SERVE} & touch /tmp/started; wait", wait_for_file("/tmp/started"))


def context():
    d = tempfile.mkdtemp(prefix="aenv-ctx-")
    os.makedirs(os.path.join(d, "app", "sub"))
    with open(os.path.join(d, "app", "hello.txt"), "w") as f:
        f.write("hello from the context\n")
    with open(os.path.join(d, "app", "sub", "deep.txt"), "w") as f:
        f.write("deep\n")
    with open(os.path.join(d, "tool.sh"), "w") as f:
        f.write("#!/bin/sh\necho tool-ran\n")
    return d


def template(ctx, last_step, rebuild=False):
    t = (
        Template(file_context_path=ctx)
        .from_image(IMAGE)
        .set_envs({"GREETING": "hi", "BUILD_SECRET": "s3cret"})
        .run_cmd("id -un > /tmp/step-user && echo step-output-line")
        .set_user("root")
        .set_workdir("/srv/app")
        .copy("app", "/srv/app/", user="user", mode=0o750)
        .copy("tool.sh", "/usr/local/bin/tool.sh", mode=0o755)
        .run_cmd('echo "$GREETING $BUILD_SECRET" > stamp && cat /proc/sys/kernel/random/uuid > stamp-early && pwd > wd')
        .set_user("user")
        .run_cmd(last_step)
    )
    return start(t, rebuild)


def run(sbx, cmd, user=None):
    r = sbx.commands.run(cmd, user=user) if user else sbx.commands.run(cmd)
    return r.stdout.strip()


def check_sandbox(alias, want_last):
    sbx = Sandbox.create(alias, timeout=300)
    try:
        name = sbx.get_info().name
        ok("get_info().name is the template's alias", name == alias, name)
        ok("sandbox runs as user by default", run(sbx, "id -un") == "user", run(sbx, "id -un"))
        ok("RUN saw the build env", run(sbx, "cat /srv/app/stamp") == "hi s3cret")
        ok("WORKDIR was the RUN's cwd", run(sbx, "cat /srv/app/wd") == "/srv/app")
        ok("the default step user is user", run(sbx, "cat /tmp/step-user") == "user")
        secret = run(sbx, 'echo "[$BUILD_SECRET]"')
        ok("build env does not reach the sandbox", secret == "[]", secret)
        ok("COPY dir content", run(sbx, "cat /srv/app/hello.txt /srv/app/sub/deep.txt") == "hello from the context\ndeep")
        owner = run(sbx, "stat -c '%U %a' /srv/app/hello.txt /srv/app/sub/deep.txt")
        ok("COPY owner and mode", owner == "user 750\nuser 750", owner)
        ok("COPY file mode", run(sbx, "stat -c %a /usr/local/bin/tool.sh") == "755")
        ok("COPY file runs", run(sbx, "/usr/local/bin/tool.sh") == "tool-ran")
        ok("last step ran", run(sbx, "cat /srv/app/last") == want_last, run(sbx, "cat /srv/app/last"))
        served = run(sbx, FETCH)
        ok("start command still serves after resume", served == "served", served)
        return run(sbx, "cat /srv/app/stamp-early")
    finally:
        sbx.kill()


def rebuild_from_cache(ctx, info, early):
    # The same template with only the last step changed: earlier steps come from the cache.
    logs2 = []
    info2 = Template.build(
        template(ctx, "echo two > /srv/app/last", rebuild=True),
        ALIAS,
        on_build_logs=lambda e: logs2.append(str(e)),
    )
    text2 = "\n".join(logs2)
    ok("rebuild keeps the template id", info2.template_id == info.template_id, (info, info2))
    cached = [line for line in logs2 if "CACHED" in line]
    ok("rebuild took the earlier steps from the cache", len(cached) == 8, text2[-3000:])
    ok("rebuild ran the changed last step", "[9/9] RUN echo two" in text2 and "CACHED [9/9]" not in text2, text2[-3000:])
    ran = [line for line in logs2 if "step-output-line" in line and "echo step-output-line" not in line]
    ok("rebuild did not rerun the cached steps", not ran, ran)
    if SDK_READY:
        ok("rebuild waited with wait_for_url", "waiting for the ready command: curl" in text2, text2[-3000:])
    early2 = check_sandbox(ALIAS, "two")
    ok("a file stamped by an earlier step is byte-identical", early2 == early, (early, early2))


def body():
    ctx = context()
    logs = []
    info = Template.build(
        template(ctx, "echo one > /srv/app/last"),
        ALIAS,
        tags=["v1"],
        on_build_logs=lambda e: logs.append(str(e)),
    )
    text = "\n".join(logs)
    ok("Template.build returns ids", bool(info.template_id and info.build_id), info)
    ok("build logs carry step output", "step-output-line" in text, text[-2000:])
    ok("build logs name the steps", "RUN id -un" in text and "COPY app /srv/app/" in text, text[-2000:])
    if SDK_READY:
        ok("the build waited with wait_for_port", "waiting for the ready command: [ -n \"$(ss -Htuln sport = :8080)\" ]" in text, text[-2000:])
    ok("Template.exists(alias)", Template.exists(ALIAS))
    ok("Template.exists(unknown) is False", not Template.exists("no-such-template-here"))
    early = check_sandbox(ALIAS, "one")

    if os.environ.get("AENV_TEST_CACHE") == "1":
        rebuild_from_cache(ctx, info, early)
    tagged = Sandbox.create(f"{ALIAS}:v1", timeout=60)
    ok("a tagged build resolves", run(tagged, "cat /srv/app/last") == "one")
    tagged.kill()

    tags = Template.get_tags(ALIAS)
    ok("tags", sorted(t.tag for t in tags) == ["default", "v1"], tags)

    # A failing RUN: the SDK raises, naming the step, its command and its output.
    bad = (
        Template(file_context_path=ctx)
        .from_image(IMAGE)
        .run_cmd("echo fine")
        .run_cmd("echo about-to-fail; exit 3")
    )
    e = raises("a failing RUN raises", BuildException, lambda: Template.build(bad, "sdk-bad"))
    msg = str(e)
    ok("the reason names step, command, code and output", "step 2" in msg and "exit 3" in msg and "code 3" in msg and "about-to-fail" in msg, msg)
    ok("a failed first build leaves no template", not Template.exists("sdk-bad"))

    # build_in_background + get_build_status (logsOffset).
    bg_template = Template(file_context_path=ctx).from_image(IMAGE).run_cmd("echo bg-step")
    if SDK_READY:
        bg_template = bg_template.set_start_cmd("exec sleep 86400", wait_for_process("sleep"))
    bg = Template.build_in_background(bg_template, "sdk-bg")
    seen, offset = [], 0
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        st = Template.get_build_status(bg, logs_offset=offset)
        offset += len(st.log_entries)
        seen.extend(st.log_entries)
        if st.status.value in ("ready", "error"):
            break
        time.sleep(0.5)
    ok("build_in_background becomes ready", st.status.value == "ready", st)
    ok("status logs have levels and timestamps", all(x.level and x.timestamp for x in seen) and any("bg-step" in x.message for x in seen), seen[-5:])
    if SDK_READY:
        said = [x.message for x in seen]
        waited = any("ready command: pgrep sleep" in m for m in said) and any("ready after" in m for m in said)
        ok("the background build waited with wait_for_process", waited, said[-5:])


if __name__ == "__main__":
    main(body)

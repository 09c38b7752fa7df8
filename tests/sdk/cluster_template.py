"""A template built with the python SDK through the cluster's load balancer (each REST
call may reach another node): Template().from_image(...) with a COPY of a file (its
upload link is given by one node and taken by another) and a RUN, built with
Template.build. AENV_TEST_IMAGE names the image, AENV_TEST_ALIAS the alias; prints the
template id as `template <id>`."""

import os
import tempfile

from check import main, ok
from e2b import Template

IMAGE = os.environ["AENV_TEST_IMAGE"]
ALIAS = os.environ["AENV_TEST_ALIAS"]


def body():
    ctx = tempfile.mkdtemp(prefix="aenv-ctx-")
    with open(os.path.join(ctx, "marker.txt"), "w") as f:
        f.write("copied through the cluster\n")
    template = (
        Template(file_context_path=ctx)
        .from_image(IMAGE)
        .copy("marker.txt", "/srv/marker.txt")
        .set_user("root")
        .run_cmd("echo built > /srv/built")
    )
    info = Template.build(template, ALIAS, cpu_count=1, memory_mb=256)
    ok("Template.build through the load balancer", bool(info.template_id), info)
    print(f"ok template {info.template_id}", flush=True)


main(body)

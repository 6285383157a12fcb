"""The main job as a Ray job: disaggregated generation checked against colocated generation.

    ray start --head
    ray job submit -- python examples/disagg_job.py --prompts 48
    ray stop

Submit it from the repository, with kvray installed on every node (`pip install -e '.[job]'`);
no `--working-dir`: that would ship a copy of the sources without the built C copy helper and
shadow the installed kvray. It joins the cluster the job runs in (RAY_ADDRESS, set by Ray for
jobs) or starts a local Ray when run directly (`python examples/disagg_job.py`). All of
`kvray demo`'s options apply. The job fails (exit status 1) unless every disaggregated output
equals the colocated one.
"""

import sys

from kvray.demo import run

if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))

"""The main job as a Ray job: disaggregated generation checked against colocated generation.

    ray start --head
    ray job submit --working-dir . -- python examples/disagg_job.py --prompts 48
    ray stop

It joins the cluster the job runs in (RAY_ADDRESS, set by Ray for jobs) or starts a local Ray when
run directly (`python examples/disagg_job.py`). All of `kvray demo`'s options apply. The job fails
(exit status 1) unless every disaggregated output equals the colocated one.
"""

import sys

from kvray.demo import run

if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))

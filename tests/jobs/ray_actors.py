"""A Ray job on a local Ray instance: actors of two classes, each attaching in ``__init__``.

The driver starts ``POLICY`` (default 2) ``DTensorPolicyWorker`` actors and one
``VllmGenerationWorker`` (NeMo RL's class names), each of which calls
``profd_client.attach(step="manual")`` and then steps by hand (``profd_client.step()``)
every STEP_SLEEP seconds (default 0.05) until the file STOP exists. The driver prints
``READY`` once every actor is up, then ``RESULT {json}`` per actor at the end.
"""

import json
import os
import sys
import time

import ray


class _Stepping:
    def __init__(self) -> None:
        import profd_client

        profd_client.attach(step="manual")

    def run(self, stop: str, pause: float) -> dict[str, object]:
        import profd_client

        give_up = time.monotonic() + 600  # a test that died must not leave actors behind
        while not os.path.exists(stop) and time.monotonic() < give_up:
            time.sleep(pause)
            profd_client.step()
        ident = profd_client.identity()
        return {
            "role": ident.role if ident else None,
            "job": ident.job if ident else None,
            "steps": profd_client.current_step(),
        }


@ray.remote(num_cpus=0)
class DTensorPolicyWorker(_Stepping):
    pass


@ray.remote(num_cpus=0)
class VllmGenerationWorker(_Stepping):
    pass


def start_ray() -> None:
    # Small and quiet: a test machine runs this beside the daemon and other tests. Ray gives
    # its raylet a fixed 30 s to register, which a loaded 2-core machine can miss: try again.
    for attempt in range(3):
        try:
            ray.init(
                num_cpus=1,
                include_dashboard=False,
                log_to_driver=True,
                object_store_memory=100 << 20,
            )
            return
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == 2:
                raise
            print(f"ray.init: {exc}; trying again", flush=True)
            ray.shutdown()


def main() -> None:
    stop = os.environ["STOP"]
    pause = float(os.environ.get("STEP_SLEEP", "0.05"))
    start_ray()
    actors = [DTensorPolicyWorker.remote() for _ in range(int(os.environ.get("POLICY", "2")))]
    actors.append(VllmGenerationWorker.remote())
    runs = [a.run.remote(stop, pause) for a in actors]
    print("READY", flush=True)
    for r in ray.get(runs):
        print("RESULT " + json.dumps(r), flush=True)
    ray.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()

"""Profile a service stage with cProfile, one profile per thread (`bench/serve.py --profile DIR`).

Python imports `sitecustomize` at start-up from the first directory on its path that has one;
bench/serve.py puts this directory first on the stages' PYTHONPATH, with NANOVLLM_PROFILE_DIR
set, only when asked to profile. In a stage process (`python -m tokenizer_proc|engine_proc|
detok_proc`) every Python thread then runs under its own profiler, and at exit each writes
`<stage>-<pid>-<thread>.prof` to that directory (read them with `pstats`). Anything else,
the supervisor included, is left alone.
"""
import os
import sys

STAGES = ("tokenizer_proc", "engine_proc", "detok_proc")


def _install(out_dir: str, stage: str) -> None:
    import atexit
    import cProfile
    import threading

    profiles: list[tuple[str, cProfile.Profile]] = []
    thread_run = threading.Thread.run

    def profiled_run(self) -> None:
        profile = cProfile.Profile()
        profiles.append((self.name, profile))
        profile.enable()
        try:
            thread_run(self)
        finally:
            profile.disable()

    def dump() -> None:
        for name, profile in profiles:
            profile.disable()  # daemon threads are still running at exit
            safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
            profile.dump_stats(os.path.join(out_dir, f"{stage}-{os.getpid()}-{safe}.prof"))

    threading.Thread.run = profiled_run
    main = cProfile.Profile()
    profiles.append(("main", main))
    atexit.register(dump)
    main.enable()


_dir = os.environ.get("NANOVLLM_PROFILE_DIR")
_argv = getattr(sys, "orig_argv", [])
if _dir and len(_argv) > 2 and _argv[1] == "-m" and _argv[2] in STAGES:
    _install(_dir, _argv[2])

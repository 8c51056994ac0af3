"""`make demo`: ScaleCom training on 2 local workers through horovodrun, then the same job dense,
and a side-by-side summary of accuracy and gradient traffic."""

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # devtools
from devtools.launch import horovodrun_command, split_by_rank

HERE = os.path.dirname(os.path.abspath(__file__))
OWN_OUTPUTS = ("--result", "--checkpoint", "--resume", "--tensorboard")  # per job: not passed on


def run_job(compression, workers, extra=()):
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        cmd = horovodrun_command([os.path.join(HERE, "pytorch_scalecom.py"), "--compression",
                                  compression, "--result", result_path, *extra], np=workers)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3")
        print(f"$ {' '.join(cmd)}", flush=True)
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) as proc:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                text = split_by_rank(line).get(0)
                if text is not None and not text.startswith("result "):
                    print("  " + text, flush=True)
        if proc.returncode != 0:
            sys.stdout.write("".join(lines[-60:]))
            raise SystemExit(f"{compression} job failed with exit code {proc.returncode}")
        with open(result_path) as f:
            return json.load(f)


def main(argv=None):
    extra = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in extra):
        print(__doc__ + "\nusage: python examples/run_demo.py [ARGUMENTS]\n\nARGUMENTS (e.g. --epochs 5 "
              "--seed 1) go to examples/pytorch_scalecom.py in both jobs; see its --help.")
        return
    for a in extra:  # (the example refuses abbreviations, so these are the only spellings)
        name = a.split("=", 1)[0]
        if name == "--compression":
            raise SystemExit("run_demo.py runs --compression scalecom and then dense itself: leave "
                             "--compression out")
        if name in OWN_OUTPUTS:
            raise SystemExit(f"run_demo.py cannot pass {name} on: both of its jobs would write (or read) "
                             f"the same place; run examples/pytorch_scalecom.py under horovodrun for it")
    sys.path.insert(0, HERE)
    from pytorch_scalecom import parse_args
    parse_args(["--compression", "dense", *extra])  # a bad argument is named here, before any job starts
    workers = 2
    scalecom = run_job("scalecom", workers, extra)
    dense = run_job("dense", workers, extra)  # the same settings: a side-by-side comparison
    print(f"\nsummary ({workers} workers, digits, {scalecom['epochs']} epochs):")
    for r in (scalecom, dense):
        print(f"  {r['compression']:8s} test accuracy {100 * r['accuracy']:6.2f}%   gradient bytes "
              f"{r['reduction']:5.1f}x fewer than dense   {r['seconds']:5.1f} s")
    gap = 100 * (scalecom["accuracy"] - dense["accuracy"])
    print(f"  ScaleCom minus dense accuracy: {gap:+.2f} points, with {scalecom['reduction']:.1f}x "
          f"fewer gradient bytes")


if __name__ == "__main__":
    main()

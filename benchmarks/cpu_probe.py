"""Why one warm figure differs between runs on the same machine: torch's stats call and a plain
Python loop, pinned to each CPU in turn (twice), with one other core kept busy.

    python benchmarks/cpu_probe.py       # needs CUDA; prints one line per CPU and repetition

Its result on the H200 host is in benchmarks/sampler_cost.md.
"""
import os, time, torch, subprocess, sys
torch.zeros(1, device="cuda")
stats = torch._C._cuda_memoryStats
def py():
    d = {}
    for i in range(200): d[i] = i * 2
    return d
busy = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: pass"])  # one busy core elsewhere
try:
    cpus = sorted(os.sched_getaffinity(0))
    for rep in range(2):
        for c in cpus:
            os.sched_setaffinity(0, {c})
            time.sleep(0.01)
            for _ in range(200): stats(0)
            t0 = time.thread_time()
            for _ in range(2000): stats(0)
            t1 = time.thread_time()
            for _ in range(2000): py()
            t2 = time.thread_time()
            print(f"rep {rep} cpu {c:2d}: stats {(t1-t0)/2000*1e6:5.1f} us  py {(t2-t1)/2000*1e6:5.1f} us", flush=True)
finally:
    busy.kill()
print(open("/proc/cpuinfo").read().split("\n\n")[0])

"""draftsmith's benchmarks: scripts that measure speed, memory and acceptance on real hardware. Nothing here is
asserted by a test; tests/test_benchmarks.py only checks that every module imports and that the run information
has its keys.

Run one from the repository root as a module (it imports its neighbours as `benchmarks.*`, nothing is added to
sys.path):

    python -m benchmarks.NAME --help

Shared code: `runinfo.run_info()` (command, git commit, versions, hardware, date: the block every result's JSON
starts with), `common` (writing a result, running a benchmark module in a child process, peak memory), `shapes`
(random targets built from config), `acceptance` (simulated greedy acceptance). Results: `results/`, one folder per
measurement with its README, whose first paragraph under the title names the commit that produced it
(README.md beside this file).
"""

"""Stand-in for the `xprof` package (not installed on the device machine).

tokamax 0.0.17 imports `xprof.cli.tools.get_kernel_stats_tool` at import time
for its own profiler-based timing; our benchmarks time kernels themselves, so
a module that defines the name as None is enough to import tokamax. Put
`benchmarks/xprof_stub` on PYTHONPATH (benchmarks.dense does so when no real
xprof is importable).
"""

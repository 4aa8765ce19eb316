"""Stand-in for xprof.cli.tools: tokamax only needs the name to exist."""
get_kernel_stats_tool = None

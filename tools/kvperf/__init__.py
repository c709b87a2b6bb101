"""kvperf: fio-style bandwidth, latency, prefix and TTFT benchmarks of a
kvtier deployment, with gates. See docs/kvperf.md; the command is
:func:`kvtier.tools.kvperf.cli.main`."""

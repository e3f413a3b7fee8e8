"""The library's command-line tools (``kvxfer status``, ``health``, ``events``, ``hint``, and the
benchmarks' table): ``commands`` registers them; the ``kvxfer`` program (``service.program``) adds
the daemon's own subcommands."""

"""The ``doccp`` command: one module per subcommand (demo, plan, bench) behind :mod:`doccp.app.cli.main`."""

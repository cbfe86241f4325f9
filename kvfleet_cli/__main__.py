from kvfleet_cli.cli import main

raise SystemExit(main())

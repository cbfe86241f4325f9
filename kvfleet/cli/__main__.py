from kvfleet.cli.cli import main

raise SystemExit(main())

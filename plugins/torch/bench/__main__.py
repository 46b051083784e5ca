"""``python -m commsched.plugins.torch.bench``: ``commsched bench`` without the main CLI."""

from commsched.bench.cli import main

raise SystemExit(main())

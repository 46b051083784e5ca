"""``python -m commsched.plugins.torch.bench``: ``commsched bench`` without the main CLI."""

from commsched.plugins.torch.bench.cli import main

raise SystemExit(main())

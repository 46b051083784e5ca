"""``python -m commsched.plugins.tensorflow.bench``: ``commsched bench --framework tensorflow`` alone."""

from commsched.plugins.tensorflow.bench.strategies import main

raise SystemExit(main())

"""The throughput drains' workflows alone, as a supervisor's workflow module
(`[workflows] modules = ["shapes"]`): a supervisor serving these declares no limit at all, as
a user of none does. bench/runtime.py serves it in its throughput and cpu drains, unless
`--limits-elsewhere` has it serve every bench workflow (runtime.py's own, with node, key and
rate limits among them), none of which the drain's steps use."""
from __future__ import annotations

from engine import SHAPES

bench_1step, bench_5step = SHAPES[1], SHAPES[5]

from __future__ import annotations

from cyclone import RunState, demo
from cyclone.testing import TestEnv


def test_demo_order_and_flaky_workflows_complete(env: TestEnv):
    order = env.client.submit(demo.orders, {"order": 1, "items": ["a", "b"]})
    env.client.signal(order, "approved", {"by": "test"})
    flaky = env.client.submit(demo.flaky, {})
    assert env.run_until_complete(order).output == {"ship": {"label": {"label": "PKG-1"}}}
    st = env.run_until_complete(flaky)
    assert (st.state, st.output) == (RunState.COMPLETED, {"call_partner": "answered on attempt 3"})

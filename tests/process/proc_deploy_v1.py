"""Version 1 of the deploy test's code (test_process_deploy.py): `orders` fetches then ships;
`pricing` waits for a signal, quotes in euros, bills. Every output names its version."""

from __future__ import annotations

import time

import cyclone

VERSION = "v1"
orders = cyclone.Workflow("proc-deploy-orders")
pricing = cyclone.Workflow("proc-deploy-pricing")


@orders.task()
def fetch(ctx: cyclone.StepContext) -> str:
    time.sleep(0.6)  # long enough for a SIGTERM to find steps under way
    return VERSION


@orders.task(after=[fetch])
def ship(ctx: cyclone.StepContext) -> str:
    time.sleep(0.2)
    return VERSION


pricing.wait("go", signal="go")


@pricing.task(after=["go"])
def quote(ctx: cyclone.StepContext) -> str:
    return f"{VERSION}:euros"


@pricing.task(after=[quote])
def bill(ctx: cyclone.StepContext) -> str:
    return f"{VERSION}:{ctx.results['quote']}"

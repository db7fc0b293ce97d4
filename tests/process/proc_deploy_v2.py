"""Version 2 of the deploy test's code: `orders` renamed `fetch` to `load` and added `notify`
(a new graph version); `pricing` keeps its graph and changes how it quotes, behind
ctx.patched("price-in-cents")."""

from __future__ import annotations

import time

import cyclone

VERSION = "v2"
orders = cyclone.Workflow("proc-deploy-orders")
pricing = cyclone.Workflow("proc-deploy-pricing")


@orders.task()
def load(ctx: cyclone.StepContext) -> str:
    time.sleep(0.3)
    return VERSION


@orders.task(after=[load])
def ship(ctx: cyclone.StepContext) -> str:
    time.sleep(0.2)
    return VERSION


@orders.task(after=[ship])
def notify(ctx: cyclone.StepContext) -> str:
    return VERSION


pricing.wait("go", signal="go")


@pricing.task(after=["go"])
def quote(ctx: cyclone.StepContext) -> str:
    if ctx.patched("price-in-cents"):
        return f"{VERSION}:cents"
    return f"{VERSION}:euros"


@pricing.task(after=[quote])
def bill(ctx: cyclone.StepContext) -> str:
    return f"{VERSION}:{ctx.results['quote']}"

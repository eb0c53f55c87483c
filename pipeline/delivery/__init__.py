"""Delivery: how finished batches reach a flotilla's trainers. Delivery plans
(plan.py, pure: the chosen topology laid out in hubs), hub processes that make and exchange batches
(hub.py), collectives between nodes (collective.py), shared-memory rings on
a node (ring.py, the stream protocol in stream.py) and the typed messages
between a flotilla and its hubs (messages.py).

May import: data, `stages`, the scheduler's types. Never training or anything above.
"""

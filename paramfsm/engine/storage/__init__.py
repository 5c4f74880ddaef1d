"""Storage: units, partitioned parameters, their shards and the placeholders that stand in for them.

What the other rooms operate on. It uses the core only; where a placeholder
needs the schedule (an on-demand gather), the schedule installs a callback.
"""

"""Where tables, rows and shards live: the tier planner and the sharding plan.

    planner.py   tiers and the hot-row cache from table sizes, access profiles and tier bandwidths
    sharding.py  which rank holds which table or row range (table-wise, row-wise, data-parallel)
"""

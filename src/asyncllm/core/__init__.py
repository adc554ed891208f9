"""The engine core: requests, scheduling, KV block accounting, stops. Plain Python: no torch, no asyncio,
no clocks (time is passed in)."""

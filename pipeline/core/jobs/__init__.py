"""The RQ job contract both sides keep: a noun a module, as rq gives each its own.

`queue`: the pool's queue, the one job function's name and RQ's data for a job (what submit
enqueues and workers run); `status`: what a job's record says (status, failure reason, origin,
canceled); `turn_log`: the format of a run's agent-turn log, written by workers and read by the
server and the readers; `rq_seam`: every use of RQ beyond its documented API.
"""

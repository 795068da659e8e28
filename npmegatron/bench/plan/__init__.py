"""`npmegatron plan` (command.py) and `npmegatron plan calibrate` (calibrate.py): the commands that
print the performance model of npmegatron.perf and write a machine profile for it."""

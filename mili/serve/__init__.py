"""`mili serve`: every service as a supervised child process on this machine.

launcher.py         the command: start the children together, supervise, drain in order
plan.py             each child's command line, built once from the flags (pure argv)
forwarded_flags.py  the children's flags `mili serve` takes, borrowed from their declarations
child.py            one supervised child process: its output, health, exit
backoff.py          restart delays of a child that keeps failing
tls.py              --tls-* for every child and for our health checks; --tls-demo
"""

import time, sys
t=time.time()
from benchmarks import roofline
from recipes.resolve import parse_args
cfg = parse_args(["--config", sys.argv[1]])
r = roofline.measure(cfg.model, cfg.optim)
print(roofline.render_table(r))
print(time.time()-t)

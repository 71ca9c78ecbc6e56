import json, sys, numpy as np
for r in sys.argv[1:]:
  try: d=json.load(open(r+'/results.json'))
  except Exception as e: print(r, 'n/a'); continue
  for s in d['per_seed']:
    m=np.array(s['acc_matrix']); print(r, 'seed', s['seed'], 'final', s['final_accuracy'], 'forget', round(s['forgetting'],3), 'TIL', round(s['final_accuracy_task_incremental'],3))
    print('  diag', np.round(np.diag(m),2), 'last row', np.round(m[-1],2))

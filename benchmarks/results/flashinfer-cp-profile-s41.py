import torch,torch.nn.functional as F
from torch.profiler import profile,ProfilerActivity as A
from flashinfer.gdn_prefill import chunk_gated_delta_rule as f
def run(hq,hv,T,cp="auto",cl=None,h0=1):
 g=torch.Generator("cuda").manual_seed(0);r=lambda*s:torch.randn(*s,generator=g,device="cuda")
 q=F.normalize(r(T,hq,128),dim=-1).bfloat16();k=F.normalize(r(T,hq,128),dim=-1).bfloat16();v=r(T,hv,128).bfloat16()
 a=(F.logsigmoid(r(T,hv))/16).exp();b=r(T,hv).sigmoid();cu=torch.tensor([0,T],device="cuda")
 s0=torch.zeros(1,hv,128,128,device="cuda") if h0 else None
 c=lambda:f(q,k,v,a,b,initial_state=s0,output_final_state=True,cu_seqlens=cu,use_cp=cp,_cp_chunk_len=cl)
 c();c();torch.cuda.synchronize();G=torch.cuda.CUDAGraph()
 with torch.cuda.graph(G):c()
 e0,e1=torch.cuda.Event(1),torch.cuda.Event(1);G.replay();e0.record()
 for _ in range(20):G.replay()
 e1.record();torch.cuda.synchronize();t=e0.elapsed_time(e1)/20
 with profile(activities=[A.CUDA]) as p:
  for _ in range(3):c()
  torch.cuda.synchronize()
 ev=sorted([x for x in p.events() if x.device_type.name=="CUDA" and "em" not in x.name[:8]],key=lambda x:x.time_range.start);n=len(ev)//3
 ks=[sorted(ev[i+j*n].time_range.elapsed_us() for j in range(3))[1] for i in range(n)]
 print(hq,hv,T,cp,cl,h0,"graph_ms=%.3f"%t,"us:",[round(x,1) for x in ks],[x.name[-28:] for x in ev[:n]],flush=True)
for hv,cls in((32,(None,4096,16384,2048)),(64,(None,8192,32768))):
 for cl in cls:
  try:run(16,hv,32768,cl=cl)
  except Exception as e:print("ERR",hv,cl,repr(e)[:300],flush=True)
 for kw in(dict(cp=False),dict(h0=0)):
  try:run(16,hv,32768,**kw)
  except Exception as e:print("ERR",hv,kw,repr(e)[:300],flush=True)

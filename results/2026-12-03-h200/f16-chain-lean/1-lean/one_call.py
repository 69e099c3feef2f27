import torch, flashopm
B, S, N, C, H, D = (2,8,32,64,32,64)
torch.manual_seed(0)
model = flashopm.ModelNew(C, D, H).cuda()
x = torch.randn(B, S, N, C, device="cuda")
mask = (torch.rand(B, S, N, device="cuda") > 0.2).float()
with torch.no_grad():
    for _ in range(5):
        model(x, mask)
torch.cuda.synchronize()

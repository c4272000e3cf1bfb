// Part of test_cuda.cu (one binary, so gpu-check runs it as one stage): what orders memory and
// errors between streams and devices: allocation against the stream that writes, copies against
// later writes to their source, pinned host blocks against their copies, device-side validation
// across checks and devices, caught out-of-memory, the allocator's host-side cache, cuDNN's
// algorithm choice, and the per-thread handle and plan lookups. Uses spin() and Mlp from
// test_cuda.cu. Where one GPU cannot show a cross-device case, the same path runs between two
// streams of cuda:0 (a skip would read as a failure on the GPU machine).

namespace {
/// Several blocks of `n` floats on `dev`'s current stream, freed there after reads that wait
/// behind a spin: a pool that hands one of them to a stream not ordered after that stream lets
/// it overwrite the block before the read runs. Returns the reads (each should hold `value`).
std::vector<Tensor<float>> free_blocks_under_pending_reads(Device dev, std::int64_t n, float value, double ms) {
  std::vector<Tensor<float>> reads;
  std::vector<Tensor<float>> victims;
  for (int i = 0; i < 4; ++i) victims.push_back(full<float>({n}, value, dev));
  spin(current_stream(dev), ms);
  for (auto& v : victims) reads.push_back(v * 1.0);
  return reads;  // the victims are freed here, in stream order after their reads
}
}  // namespace

TEST(Cuda, NcclReduceAllocatesOnTheStreamThatWrites) {
  REQUIRE_GPU();
  // Note [allocate on the stream that writes] (comm.hpp): the flat send buffers (rank 0 and
  // idle ranks send zeros) and the receive buffer were allocated on the caller's stream and
  // written at once on the communication streams, overwriting blocks whose reads were queued.
  std::vector<Stream*> streams;
  for (int d = 0; d < cuda_device_count(); ++d) streams.push_back(&get_stream(Device::cuda(d), 0));
  parallel::NcclCommunicator comm(streams);
  constexpr std::int64_t kN = 1 << 20;
  auto dst = full<float>({kN}, 5.0f, kGpu);
  for (int d = 0; d < cuda_device_count(); ++d) synchronize(Device::cuda(d));
  std::vector<Tensor<float>> reads;
  for (int d = 0; d < cuda_device_count(); ++d)
    for (auto& t : free_blocks_under_pending_reads(Device::cuda(d), kN, 7.0f, 100)) reads.push_back(std::move(t));
  comm.reduce_add({}, {AnyTensor(dst)});  // every rank sends zeros: all flat buffers are written by memset
  for (int d = 0; d < cuda_device_count(); ++d) synchronize(Device::cuda(d));
  for (std::size_t i = 0; i < reads.size(); ++i)
    EXPECT_EQ(reads[i].sum().item(), 7.0f * kN) << "read " << i << " saw memory the reduction wrote";
  EXPECT_EQ(dst.sum().item(), 0.0f);  // the sum of zeros replaced the fives
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(Cuda, ACopyOrdersTheSourcesNextWriteAfterItsRead) {
  REQUIRE_GPU();
  // Note [cross-stream copies] (storage.hpp): the copy runs on the destination's stream; a later
  // in-place write to the source on its own stream must wait for it.
  constexpr std::int64_t kN = 1 << 22;
  {  // two streams of cuda:0: the core of every cross-device copy
    auto src = full<float>({kN}, 3.0f, kGpu);
    auto dst = zeros<float>({kN}, kGpu);
    synchronize(kGpu);
    Stream& s0 = current_stream(kGpu);
    Stream& s3 = get_stream(kGpu, 3);
    spin(s3, 100);  // the copy stays queued
    chorus::detail::copy_between_streams(dst.data(), kGpu, s3, src.data(), kGpu, s0, sizeof(float) * kN);
    (void)src.fill_(-1.0f);  // on s0
    Event copied;
    copied.record(s3);
    copied.block(s0);
    EXPECT_EQ(dst.sum().item(), 3.0f * kN) << "the write to the source overtook the copy";
  }
  if (cuda_device_count() > 1) {  // a real copy between GPUs
    const Device d1 = Device::cuda(1);
    auto src = full<float>({kN}, 3.0f, kGpu);
    synchronize(kGpu);
    spin(current_stream(d1), 100);
    auto dst = src.to(d1);  // on cuda:1's stream, behind the spin
    (void)src.fill_(-1.0f);
    EXPECT_EQ(dst.sum().item(), 3.0f * kN) << "the write to the source overtook the copy to cuda:1";
  }
}

TEST(Cuda, HostToDeviceCopiesFromPinnedMemoryDoNotWaitAndKeepTheirBlock) {
  REQUIRE_GPU();
  // Note [async host-to-device copies], Note [deferred host frees].
  constexpr std::int64_t kN = 1 << 20;
  auto& pinned = pinned_host_allocator();
  auto host = data::pin(full<float>({kN}, 2.0f));
  ASSERT_NE(static_cast<const void*>(host.data()), nullptr);
  auto dev = Tensor<float>::empty({kN}, kGpu);
  synchronize(kGpu);
  Stream& s = current_stream(kGpu);
  spin(s, 200);
  Event busy;
  busy.record(s);
  (void)dev.copy_(host);
  if (chorus::detail::caching_allocator_enabled() && !cuda::debug_sync_enabled())
    EXPECT_FALSE(busy.query()) << "a copy from pinned memory waited for the device";
  // The batch is dropped while its copy is still queued: its block must wait for the copy.
  const void* block = host.data();
  const auto pending = pinned.pending();
  host = Tensor<float>();
  EXPECT_EQ(pinned.pending(), pending + 1) << "a block that a copy reads was freed for reuse at once";
  if (!busy.query()) {  // the copy has surely not run yet
    auto next = data::pin(full<float>({kN}, -1.0f));  // the same size, written on the host at once
    EXPECT_NE(static_cast<const void*>(next.data()), block) << "a pinned block was reused under its copy";
  }
  EXPECT_EQ(dev.sum().item(), 2.0f * kN);
  // Once the copy is done the block is reused (it is found on the next allocation).
  auto later = data::pin(full<float>({kN}, 0.0f));
  EXPECT_LE(pinned.pending(), pending);
  // A copy from pageable memory still returns only once the host buffer has been read.
  std::vector<float> pageable(static_cast<std::size_t>(kN), 6.0f);
  auto from_pageable = from_vector<float>(pageable, {kN}, kGpu);
  std::fill(pageable.begin(), pageable.end(), -6.0f);
  EXPECT_EQ(from_pageable.sum().item(), 6.0f * kN);
}

TEST(Cuda, APinnedBufferCopiedEveryStepHoldsOneEventNotOnePerCopy) {
  REQUIRE_GPU();
  // Note [deferred host frees]: a staging buffer that stays alive keeps the latest copy's event
  // per stream; the earlier ones go back to the pool (they used to pile up, one per copy).
  auto host = data::pin(full<float>({1024}, 1.0f));
  auto dev = Tensor<float>::empty({1024}, kGpu);
  for (int i = 0; i < 3; ++i) (void)dev.copy_(host);
  synchronize(kGpu);
  const auto created = cuda::EventPool::get().created();
  for (int i = 0; i < 100; ++i) (void)dev.copy_(host);
  EXPECT_EQ(cuda::EventPool::get().created(), created) << "every copy from a live pinned block kept its own event";
  EXPECT_EQ(dev.sum().item(), 1024.0f);
}

TEST(Cuda, DeviceSideValidationSurvivesAConcurrentReportAndReachesEverySync) {
  REQUIRE_GPU();
  // Note [re-arming device-side validation]: a kernel of another stream that reports while a
  // check re-arms keeps its report, and the device reports again afterwards.
  auto m = randn<float>({6, 7}, kGpu);
  auto idx = [](std::int64_t bad) { return from_vector<std::int64_t>({0, bad}).to(kGpu); };
  auto i7 = idx(7), i8 = idx(8), i9 = idx(9);
  synchronize(kGpu);
  Stream& s0 = current_stream(kGpu);
  Stream& s2 = get_stream(kGpu, 2);
  auto first = m.index_select(1, i7);  // reports at once on s0
  Tensor<float> second;
  {
    StreamGuard g(s2);
    spin(s2, 100);
    second = m.index_select(1, i8);  // runs while the first check waits for the device
  }
  EXPECT_TRUE(throws_with([&] { s0.synchronize(); }, {"index_select", "index 7", "cuda:0"}));
  // Freeing memory without the caching allocator, and CHORUS_DEBUG_SYNC, synchronise the device
  // earlier: the second kernel then runs while the first report still holds the guard.
  if (chorus::detail::caching_allocator_enabled() && !cuda::debug_sync_enabled())
    EXPECT_TRUE(throws_with([&] { s2.synchronize(); }, {"index 8"})) << "the concurrent report was erased";
  else
    s2.synchronize();
  EXPECT_TRUE(throws_with([&] { m.index_select(1, i9).to_vector(); }, {"index 9"}))
      << "the guard stayed claimed: bad indices are no longer reported";
  // A replica's bad index is reported by the primary's sync (Note [device-side validation]).
  // With one GPU the replica is another stream of cuda:0 (a repeated-GPU set).
  const Device replica = cuda_device_count() > 1 ? Device::cuda(1) : kGpu;
  Stream& rs = cuda_device_count() > 1 ? current_stream(replica) : get_stream(kGpu, 4);
  Stream& primary = current_stream(kGpu);
  Tensor<float> gathered;
  {
    StreamGuard g(rs);
    auto mr = m.to(replica);
    auto out = mr.index_select(1, from_vector<std::int64_t>({0, 11}).to(replica));
    Event produced;  // as a gather orders the primary after the replica
    produced.record(rs);
    produced.block(primary);
    gathered = out;
  }
  auto loss = gathered.to(kGpu).sum();
  EXPECT_TRUE(throws_with([&] { (void)loss.item(); }, {"index 11", replica.str().c_str()}));
  EXPECT_NO_THROW((void)loss.item()) << "reported twice";
}

TEST(Cuda, ACaughtOutOfMemoryIsNotBlamedOnTheNextKernel) {
  REQUIRE_GPU();
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_TRUE(throws_with([] { (void)Tensor<float>::empty({std::int64_t{1} << 45}, kGpu); },  // 128 TiB
                          {"out of memory", "cuda:0"}));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the out-of-memory error stayed in the last-error slot";
  auto x = full<float>({16}, 1.0f, kGpu);  // a kernel launch checks the last-error slot
  EXPECT_EQ(x.sum().item(), 16.0f);
}

TEST(Cuda, TheSteadyStateAllocatesFromTheHostCacheInStreamOrder) {
  REQUIRE_GPU();
  // Note [CUDA block cache]
  auto& alloc = static_cast<CudaCachingAllocator&>(allocator_of(kGpu));
  const bool caching = chorus::detail::caching_allocator_enabled();
  {
    Mlp m = nn::clone(Mlp(), kGpu);
    optim::SGD opt(m.parameters(), {.lr = 0.01});
    auto x = randn<float>({256, 32}, kGpu), y = randn<float>({256, 4}, kGpu);
    auto step = [&] {
      auto loss = F::mse_loss(m.forward(x), y);
      opt.zero_grad();
      loss.backward();
      opt.step();
    };
    step();
    step();
    const auto misses = alloc.cache_misses();
    const auto allocs = memory_stats(kGpu).num_allocs;
    for (int i = 0; i < 5; ++i) step();
    EXPECT_GT(memory_stats(kGpu).num_allocs, allocs);
    if (caching) EXPECT_EQ(alloc.cache_misses(), misses) << "the steady state called the driver to allocate";
    synchronize(kGpu);
  }
  // A cached block taken again on its own stream waits for another stream's use of it.
  constexpr std::int64_t kN = 1 << 20;
  Stream& s2 = get_stream(kGpu, 2);
  Tensor<float> read;
  {
    auto t = full<float>({kN}, 4.0f, kGpu);
    synchronize(kGpu);
    {
      StreamGuard g(s2);
      spin(s2, 100);
      read = t * 1.0;  // on s2, behind the spin
    }
    record_stream(t.data(), kGpu, s2);
  }  // freed on cuda:0's stream 0 while s2 still has to read it
  auto reuse = full<float>({kN}, -1.0f, kGpu);  // the same size on the same stream: t's block
  Event e;
  e.record(s2);
  e.block(current_stream(kGpu));
  EXPECT_EQ(read.sum().item(), 4.0f * kN);
  if (caching) {
    alloc.empty_cache();
    EXPECT_EQ(alloc.cached_bytes(), 0u);
  }
}

TEST(Cuda, ProductsFromManyThreadsAndStreamsMatchTheCpu) {
  REQUIRE_GPU();
  // Note [per-thread lookups]: handles and plans remembered per thread, made once per stream/key.
  auto a = r<float>({64, 48}, 1), b = r<float>({48, 32}, 2), w = r<float>({32, 48}, 3), bias = r<float>({32}, 4);
  const auto ref = matmul(a, b), ref_lin = linear(a, w, bias);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      try {
        StreamGuard g(get_stream(kGpu, 20 + t));  // a stream per thread (one issuer per stream)
        for (int i = 0; i < 10; ++i) {
          auto p = matmul(a.to(kGpu), b.to(kGpu)).to(Device::cpu());
          auto l = linear(a.to(kGpu), w.to(kGpu), bias.to(kGpu)).to(Device::cpu());
          if (!all_close(p, ref, 1e-4, 1e-4) || !all_close(l, ref_lin, 1e-4, 1e-4)) ++failures;
        }
      } catch (...) {
        ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}

#if CHORUS_HAS_CUDNN
TEST(Cuda, CudnnPlansRunUnderTheirAlgorithmsMathTypeAndWorkspace) {
  REQUIRE_GPU();
  // Note [cuDNN algorithm choice]
  namespace cd = backend::cuda::cudnn;
  backend::Window2d g;
  g.C = 8;
  g.H = g.W = 16;
  g.kh = g.kw = 3;
  g.ph = g.pw = 1;
  g.OH = g.OW = 16;
  const std::int64_t N = 4, O = 16, groups = 1;
  cudnnHandle_t h = cd::handle_for(kGpu, current_stream(kGpu).handle());
  auto math_of = [](cudnnConvolutionDescriptor_t c) {
    cudnnMathType_t m{};
    CHORUS_CUDNN_CHECK(cudnnGetConvolutionMathType(c, &m));
    return m;
  };
  for (bool tf32 : {false, true}) {
    for (bool det : {false, true}) {
      SCOPED_TRACE(std::string(tf32 ? "tf32" : "fp32") + (det ? ", deterministic" : ""));
      cuda::set_allow_tf32(tf32);
      cd::set_deterministic(det);
      auto& p = cd::plan<float>(h, kGpu, g, N, O, groups);
      for (auto c : {p.conv_fwd, p.conv_bwd_data, p.conv_bwd_filter}) {
        const auto m = math_of(c);
        EXPECT_NE(m, CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) << "float data converted to half precision";
        if (!tf32) EXPECT_EQ(m, CUDNN_FMA_MATH) << "TF32 was not asked for";
      }
      std::size_t ws = 0;
      CHORUS_CUDNN_CHECK(cudnnGetConvolutionForwardWorkspaceSize(h, p.x, p.w, p.conv_fwd, p.y, p.fwd, &ws));
      EXPECT_EQ(p.fwd_ws, ws);
      CHORUS_CUDNN_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(h, p.w, p.y, p.conv_bwd_data, p.x, p.bwd_data, &ws));
      EXPECT_EQ(p.bwd_data_ws, ws);
      CHORUS_CUDNN_CHECK(
          cudnnGetConvolutionBackwardFilterWorkspaceSize(h, p.x, p.y, p.conv_bwd_filter, p.w, p.bwd_filter, &ws));
      EXPECT_EQ(p.bwd_filter_ws, ws);
      if (det) {  // the chosen backward-filter algorithm is one cuDNN calls deterministic
        cudnnConvolutionBwdFilterAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
        int n = 0;
        CHORUS_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
            h, p.x, p.y, p.conv_bwd_filter, p.w, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &n, perf));
        for (int k = 0; k < n; ++k)
          if (perf[k].algo == p.bwd_filter && perf[k].status == CUDNN_STATUS_SUCCESS &&
              perf[k].mathType == math_of(p.conv_bwd_filter))
            EXPECT_EQ(perf[k].determinism, CUDNN_DETERMINISTIC) << "algorithm " << p.bwd_filter;
      }
    }
  }
  // Deterministic: the same weight gradient, bitwise, twice.
  cuda::set_allow_tf32(false);
  cd::set_deterministic(true);
  auto x = r<float>({N, g.C, g.H, g.W}, 5).to(kGpu), w = r<float>({O, g.C, 3, 3}, 6).to(kGpu);
  auto grad_w = [&] {
    auto wv = w.detach().requires_grad_(true);
    conv2d(x, wv, Tensor<float>(), {1, 1}, {1, 1}).sum().backward();
    return wv.grad().to(Device::cpu()).to_vector();
  };
  EXPECT_EQ(grad_w(), grad_w());
  cd::set_deterministic(false);
}
#endif

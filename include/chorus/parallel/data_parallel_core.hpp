#pragma once
// DataParallelCore: what DataParallel<M> holds and does whatever the module's type: its devices,
// their streams and communicator, the options, and the checks and scheduling around a step. It
// is compiled into chorus::compiled (Note [compiled chorus]); DataParallel<M> adds the module,
// its replicas and the forward passes, which depend on M.
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../compiled.hpp"
#include "../core/stream.hpp"
#include "../nn/module.hpp"
#include "comm.hpp"
#include "data_parallel_options.hpp"
#include "scatter.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {

/// What DataParallel and parallel::FullyShardedDataParallel hold whatever the module's type: the
/// devices, their streams and communicator, the options, and the checks and scheduling around a
/// step. Its protected members are internal: the hooks of those wrappers.
class DataParallelCore {
 public:
  DataParallelCore(const DataParallelCore&) = delete;
  DataParallelCore& operator=(const DataParallelCore&) = delete;

  /// The prefix of the registry's names (DataParallel::set_name_prefix).
  const std::string& name_prefix() const { return name_prefix_; }
  /// Steps whose work off the caller is at most this run on the calling thread (Note [inline
  /// small steps]); 0: never.
  std::int64_t inline_work() const { return inline_work_; }
  /// The devices, the primary first: replica r runs on devices()[r].
  const std::vector<Device>& devices() const { return devices_; }
  /// The device the outputs are gathered on (default devices()[0]).
  Device output_device() const { return output_device_; }
  /// The dim inputs are split and outputs joined along where scatter_dims() and gather_dims() say nothing.
  std::int64_t dim() const { return dim_; }
  /// The split dim of each forward argument (Note [scatter and gather dims]).
  const std::vector<std::int64_t>& scatter_dims() const { return scatter_dims_; }
  /// The join dim of each element of the returned tuple (Note [scatter and gather dims]).
  const std::vector<std::int64_t>& gather_dims() const { return gather_dims_; }

 protected:
  /// Validates the devices and dims of `options` (default devices: available_devices()).
  explicit DataParallelCore(DataParallelOptions options);
  ~DataParallelCore() = default;

  /// Checks `prefix` (empty, or dotted names ending in '.') and makes it name_prefix().
  void set_name_prefix_core(std::string prefix);
  /// Checks `work` (>= 0) and makes it inline_work().
  void set_inline_work_core(std::int64_t work);

  /// Streams (slot = how often the device came before) and the communicator for `devices`.
  struct Links {
    std::vector<Stream*> streams;        ///< replica r's stream on devices[r]
    std::shared_ptr<Communicator> comm;  ///< the communicator over those streams
  };
  /// The Links of `devices`: their streams and a communicator (copies, or NCCL for distinct GPUs).
  static Links link(const std::vector<Device>& devices);
  /// The gradient bucket size for `devices` (the option, else the default of their kind).
  std::size_t bucket_bytes_for(const std::vector<Device>& devices) const;
  /// Adopts `links`, and whether the module has buffers and a layer that meets the other
  /// replicas (SyncBatchNorm), for the steps to come.
  void install_links(Links&& links, bool has_buffers, bool meets_other_replicas) noexcept;

  /// The devices after DataParallel::to(device).
  struct Moved {
    std::vector<Device> devices;  ///< the new device list, `device` first
    Device output;                ///< the new output device
  };
  /// Refuses a `device` of another kind than devices()[0]'s (DataParallel::to).
  void check_move(Device device) const;
  /// The devices after to(`device`): `device` first, then the others in order without it (or,
  /// when it is new, without devices()[0]); an output device that was the primary follows it.
  Moved moved_to(Device device) const;
  /// Makes `devices` the devices and `output` the output device.
  void set_devices(std::vector<Device> devices, Device output);

  /// Every parameter and buffer of `root` is on `device`.
  static bool module_on(const nn::Module& root, Device device);
  /// What DataParallel::to may change in the module's tensors, to put back when it fails.
  struct SavedTensor {
    std::function<void()> restore;  ///< puts back the tensor's storage, offset, strides, gradient and accumulator
  };
  /// A SavedTensor for every parameter and buffer of `root`.
  static std::vector<SavedTensor> save_tensors(nn::Module& root);
  /// Restores every tensor of `saved`.
  static void restore_tensors(const std::vector<SavedTensor>& saved);

  /// `named` with name_prefix() put before every name.
  std::vector<nn::Module::NamedTensor> prefixed(std::vector<nn::Module::NamedTensor> named) const;

  /// Marks the DataParallel busy for a scope; a second thread entering meanwhile gets an error
  /// (Note [DataParallel threads]).
  class InUse {
   public:
    /// Sets `flag`; throws chorus::Error if it was set already. The destructor clears it.
    explicit InUse(std::atomic<bool>& flag);
    ~InUse() { flag_.store(false, std::memory_order_release); }
    InUse(const InUse&) = delete;
    InUse& operator=(const InUse&) = delete;

   private:
    std::atomic<bool>& flag_;
  };

  /// Refuses a forward from a device worker thread (Note [DataParallel threads]).
  void check_not_nested() const;
  /// Note [active window].
  void keep_workers_hot(std::size_t used);
  /// Note [buffers written in forward].
  void wait_for_broadcasts();
  /// Replica streams start after the work issued so far on the primary's (CUDA devices).
  void fork_replica_streams();
  /// The split dim of forward argument `i`: scatter_dims()[i], else dim().
  std::int64_t scatter_dim(std::size_t i) const;

  std::vector<Device> devices_;  ///< devices()
  Device output_device_;         ///< output_device()
  std::int64_t dim_;             ///< dim()
  /// scatter_dims() and gather_dims() (Note [scatter and gather dims]).
  ///@{
  std::vector<std::int64_t> scatter_dims_, gather_dims_;
  ///@}
  int random_dim_ = 0;  ///< the split dim of this step's first split tensor (Note [dropout random numbers])
  std::optional<std::size_t> bucket_bytes_;  ///< the gradient bucket size; nullopt: the default of the devices' kind
  std::string name_prefix_;                  ///< name_prefix(), of named_parameters() etc. (set_name_prefix)
  std::atomic<bool> in_forward_{false};      ///< set while a thread is inside forward or to() (InUse)
  std::int64_t inline_work_ = inline_work_default();  ///< inline_work()
  std::chrono::steady_clock::time_point last_forward_{};  ///< when keep_workers_hot() last ran (Note [active window])
  std::vector<Stream*> streams_;        ///< replica r's stream at [r] (Links::streams)
  std::shared_ptr<Communicator> comm_;  ///< the devices' communicator (Links::comm)
  bool has_buffers_ = false;  ///< the module has buffers (Note [buffers written in forward])
  bool meets_other_replicas_ = false;  ///< a SyncBatchNorm inside: never run replicas one after another
};

namespace detail {
/// The communicator for a device list: copies for CPU devices and repeated GPUs; the CUDA
/// backend overrides this for distinct GPUs (see backend/cuda/nccl.hpp).
CHORUS_INLINE std::shared_ptr<Communicator> make_communicator(const std::vector<Device>& devices,
                                                              const std::vector<Stream*>& streams);
}  // namespace detail

}  // namespace parallel
CHORUS_NAMESPACE_END

#if !CHORUS_COMPILED
#include "data_parallel_core_impl.hpp"
#endif

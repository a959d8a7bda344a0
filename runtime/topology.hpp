// The machine as the worker pools see it: NUMA nodes, each with its PUs listed physical cores
// first and SMT siblings after, read through hwloc from the real machine, a synthetic description
// ("node:2 core:4 pu:2") or an XML export. A synthetic or XML topology never binds anything (its
// PUs are not this machine's); it exists so tests and CI can run multi-node layouts anywhere.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace ktjit {

struct NumaNode {
  int os_index = 0;      // the id users name in numa_nodes (hwloc's os_index)
  int cores = 0;         // physical cores whose PUs are in this node
  std::vector<int> pus;  // PU os indices: first PU of every core, then every core's second PU, ...
};

// One pool of a plan: the node it is bound to and one PU per thread (thread 0 first). Pool 0's
// thread 0 is the caller, which is never pinned; its PU is kept free for it.
struct PoolPlan {
  int node = 0;            // index into Topology::nodes()
  int node_os = 0;         // that node's os index
  int requested = 0;       // the os index numa_nodes asked for
  bool node_found = true;  // false: numa_nodes named a node the topology lacks (wrapped around)
  std::vector<int> pus;
  int threads() const { return int(pus.size()); }
};

class Topology {
 public:
  // The real machine (hwloc); if hwloc cannot load it, one node of hardware_concurrency PUs that
  // binds nothing.
  static std::shared_ptr<Topology> machine();
  // hwloc synthetic syntax, e.g. "node:2 core:2 pu:2" or "pack:2 numa:2 core:8 pu:2".
  static std::shared_ptr<Topology> synthetic(const std::string& description);
  // An hwloc XML export (lstopo foo.xml).
  static std::shared_ptr<Topology> xml(const std::string& path);
  // KT_JIT_TOPOLOGY: an existing file is read as XML, anything else as a synthetic description;
  // unset or empty: the machine. Throws std::invalid_argument when hwloc rejects it.
  static std::shared_ptr<Topology> from_env();

  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;
  ~Topology();

  const std::vector<NumaNode>& nodes() const { return nodes_; }
  int num_pus() const;
  int num_cores() const;
  // True only for the real machine loaded by hwloc: PUs and nodes can be bound.
  bool can_bind() const { return can_bind_; }
  // "machine", "synthetic:<description>" or "xml:<path>".
  const std::string& source() const { return source_; }
  std::string describe() const;  // e.g. "2 NUMA nodes (0: 4 cores/8 PUs, 1: ...), synthetic:..."

  // `pools` pools over `threads` threads (split evenly, at least one per pool). Pool p goes to
  // the node whose os index is numa_nodes[p] (default p); a node the topology lacks wraps to
  // index numa_nodes[p] % nodes (node_found = false). Pools sharing a node take consecutive runs
  // of its PU order, so cores fill before SMT siblings and pools never share a PU until the
  // node runs out of PUs.
  std::vector<PoolPlan> plan(int pools, int threads, const std::vector<int>& numa_nodes = {}) const;

  // Binding; each returns false (and does nothing) when !can_bind() or the OS refuses.
  bool bind_thread_to_pu(int pu_os) const;          // the calling thread
  bool bind_thread_memory_to_node(int node) const;  // calling thread's future allocations
  bool bind_area_to_node(void* p, size_t bytes, int node) const;  // pages not yet touched

 private:
  Topology() = default;
  void read_nodes();
  void* topo_ = nullptr;  // hwloc_topology_t
  bool can_bind_ = false;
  std::string source_;
  std::vector<NumaNode> nodes_;
};

// One "[kt-jit] warning: ..." line on stderr per distinct `key`, for the process's lifetime.
void warn_once(const std::string& key, const std::string& message);

}  // namespace ktjit

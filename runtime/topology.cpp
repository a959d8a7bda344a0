#include "runtime/topology.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#ifndef KT_JIT_NO_HWLOC  // AArch64 builds may come without hwloc: one unbound node then
#include <hwloc.h>
#endif

namespace ktjit {

void warn_once(const std::string& key, const std::string& message) {
  static std::mutex mu;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lock(mu);
  if (!seen.insert(key).second) return;
  std::fprintf(stderr, "[kt-jit] warning: %s\n", message.c_str());
}

#ifdef KT_JIT_NO_HWLOC
std::shared_ptr<Topology> Topology::machine() {
  std::shared_ptr<Topology> t(new Topology());
  t->source_ = "machine";
  NumaNode n;
  const int pus = std::max(1u, std::thread::hardware_concurrency());
  for (int i = 0; i < pus; ++i) n.pus.push_back(i);
  n.cores = pus;
  t->nodes_.push_back(n);
  return t;
}
std::shared_ptr<Topology> Topology::synthetic(const std::string& description) {
  throw std::invalid_argument("KT_JIT_TOPOLOGY='" + description +
                              "': this build has no hwloc to read a topology");
}
std::shared_ptr<Topology> Topology::xml(const std::string& path) {
  return synthetic(path);
}
Topology::~Topology() = default;
void Topology::read_nodes() {}
bool Topology::bind_thread_to_pu(int) const {
  return false;
}
bool Topology::bind_thread_memory_to_node(int) const {
  return false;
}
bool Topology::bind_area_to_node(void*, size_t, int) const {
  return false;
}
#else
namespace {

hwloc_topology_t as_topo(void* p) {
  return static_cast<hwloc_topology_t>(p);
}

// PUs of `set` in hwloc's logical order.
std::vector<hwloc_obj_t> objs_inside(hwloc_topology_t t, hwloc_const_cpuset_t set,
                                     hwloc_obj_type_t type) {
  std::vector<hwloc_obj_t> v;
  for (hwloc_obj_t o = hwloc_get_next_obj_inside_cpuset_by_type(t, set, type, nullptr); o;
       o = hwloc_get_next_obj_inside_cpuset_by_type(t, set, type, o))
    v.push_back(o);
  return v;
}

// First PU of every core, then the second PUs, ...: threads fill physical cores before they
// share one with an SMT sibling.
std::vector<int> cores_first(hwloc_topology_t t, hwloc_const_cpuset_t set, int* ncores) {
  std::vector<std::vector<int> > per_core;
  for (hwloc_obj_t core : objs_inside(t, set, HWLOC_OBJ_CORE)) {
    std::vector<int> pus;
    for (hwloc_obj_t pu : objs_inside(t, core->cpuset, HWLOC_OBJ_PU))
      pus.push_back(int(pu->os_index));
    if (!pus.empty()) per_core.push_back(pus);
  }
  if (per_core.empty())  // no core objects (some VMs): every PU is its own core
    for (hwloc_obj_t pu : objs_inside(t, set, HWLOC_OBJ_PU))
      per_core.push_back({int(pu->os_index)});
  *ncores = int(per_core.size());
  std::vector<int> order;
  for (size_t round = 0;; ++round) {
    bool any = false;
    for (auto& c : per_core)
      if (round < c.size()) {
        order.push_back(c[round]);
        any = true;
      }
    if (!any) break;
  }
  return order;
}

}  // namespace

std::shared_ptr<Topology> Topology::machine() {
  std::shared_ptr<Topology> t(new Topology());
  t->source_ = "machine";
  hwloc_topology_t topo = nullptr;
  if (hwloc_topology_init(&topo) == 0 && hwloc_topology_load(topo) == 0) {
    t->topo_ = topo;
    t->can_bind_ = hwloc_topology_is_thissystem(topo) != 0;
    t->read_nodes();
  } else {
    if (topo) hwloc_topology_destroy(topo);
    warn_once("hwloc-load", "hwloc could not load the topology; threads and memory are not bound");
  }
  if (t->nodes_.empty()) {  // hwloc failed or found no node with PUs
    NumaNode n;
    const int pus = std::max(1u, std::thread::hardware_concurrency());
    for (int i = 0; i < pus; ++i) n.pus.push_back(i);
    n.cores = pus;
    t->nodes_.push_back(n);
    t->can_bind_ = false;
  }
  return t;
}

std::shared_ptr<Topology> Topology::synthetic(const std::string& description) {
  std::shared_ptr<Topology> t(new Topology());
  t->source_ = "synthetic:" + description;
  hwloc_topology_t topo = nullptr;
  if (hwloc_topology_init(&topo) != 0) throw std::runtime_error("hwloc_topology_init failed");
  if (hwloc_topology_set_synthetic(topo, description.c_str()) != 0 ||
      hwloc_topology_load(topo) != 0) {
    hwloc_topology_destroy(topo);
    throw std::invalid_argument("KT_JIT_TOPOLOGY: hwloc rejects the synthetic topology '" +
                                description + "' (example: \"node:2 core:4 pu:2\")");
  }
  t->topo_ = topo;
  t->read_nodes();
  if (t->nodes_.empty())
    throw std::invalid_argument("KT_JIT_TOPOLOGY: '" + description + "' has no PUs");
  return t;
}

std::shared_ptr<Topology> Topology::xml(const std::string& path) {
  std::shared_ptr<Topology> t(new Topology());
  t->source_ = "xml:" + path;
  hwloc_topology_t topo = nullptr;
  if (hwloc_topology_init(&topo) != 0) throw std::runtime_error("hwloc_topology_init failed");
  if (hwloc_topology_set_xml(topo, path.c_str()) != 0 || hwloc_topology_load(topo) != 0) {
    hwloc_topology_destroy(topo);
    throw std::invalid_argument("KT_JIT_TOPOLOGY: hwloc cannot read the XML topology '" + path +
                                "'");
  }
  t->topo_ = topo;
  // An XML export of this very machine would still name real PUs, but nothing guarantees it is
  // this machine: never bind from a file.
  t->read_nodes();
  if (t->nodes_.empty()) throw std::invalid_argument("KT_JIT_TOPOLOGY: '" + path + "' has no PUs");
  return t;
}

Topology::~Topology() {
  if (topo_) hwloc_topology_destroy(as_topo(topo_));
}

void Topology::read_nodes() {
  hwloc_topology_t t = as_topo(topo_);
  const int n = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < n; ++i) {
    hwloc_obj_t node = hwloc_get_obj_by_type(t, HWLOC_OBJ_NUMANODE, unsigned(i));
    if (!node || !node->cpuset || hwloc_bitmap_iszero(node->cpuset)) continue;  // memory-only
    NumaNode nn;
    nn.os_index = int(node->os_index);
    nn.pus = cores_first(t, node->cpuset, &nn.cores);
    if (!nn.pus.empty()) nodes_.push_back(nn);
  }
  if (nodes_.empty()) {  // no NUMA objects with PUs: the whole machine as one node
    NumaNode nn;
    nn.pus = cores_first(t, hwloc_topology_get_topology_cpuset(t), &nn.cores);
    if (!nn.pus.empty()) nodes_.push_back(nn);
  }
}

bool Topology::bind_thread_to_pu(int pu_os) const {
  if (!can_bind_ || !topo_) return false;
  hwloc_bitmap_t set = hwloc_bitmap_alloc();
  hwloc_bitmap_only(set, unsigned(pu_os));
  const bool ok = hwloc_set_cpubind(as_topo(topo_), set, HWLOC_CPUBIND_THREAD) == 0;
  hwloc_bitmap_free(set);
  return ok;
}

namespace {
hwloc_obj_t node_obj(hwloc_topology_t t, int os_index) {
  const int n = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < n; ++i) {
    hwloc_obj_t o = hwloc_get_obj_by_type(t, HWLOC_OBJ_NUMANODE, unsigned(i));
    if (o && int(o->os_index) == os_index) return o;
  }
  return nullptr;
}
}  // namespace

bool Topology::bind_thread_memory_to_node(int node) const {
  if (!can_bind_ || !topo_ || node < 0 || node >= int(nodes_.size())) return false;
  hwloc_obj_t o = node_obj(as_topo(topo_), nodes_[size_t(node)].os_index);
  if (!o) return false;
  return hwloc_set_membind(as_topo(topo_), o->nodeset, HWLOC_MEMBIND_BIND,
                           HWLOC_MEMBIND_THREAD | HWLOC_MEMBIND_BYNODESET) == 0;
}

bool Topology::bind_area_to_node(void* p, size_t bytes, int node) const {
  if (!can_bind_ || !topo_ || !p || !bytes || node < 0 || node >= int(nodes_.size())) return false;
  hwloc_obj_t o = node_obj(as_topo(topo_), nodes_[size_t(node)].os_index);
  if (!o) return false;
  return hwloc_set_area_membind(as_topo(topo_), p, bytes, o->nodeset, HWLOC_MEMBIND_BIND,
                                HWLOC_MEMBIND_BYNODESET) == 0;
}

#endif  // KT_JIT_NO_HWLOC

std::shared_ptr<Topology> Topology::from_env() {
  const char* env = std::getenv("KT_JIT_TOPOLOGY");
  if (!env || !*env) return machine();
  const std::string v(env);
  struct stat st;
  return stat(v.c_str(), &st) == 0 ? xml(v) : synthetic(v);
}

int Topology::num_pus() const {
  int n = 0;
  for (auto& x : nodes_) n += int(x.pus.size());
  return n;
}

int Topology::num_cores() const {
  int n = 0;
  for (auto& x : nodes_) n += x.cores;
  return n;
}

std::string Topology::describe() const {
  std::string s = std::to_string(nodes_.size()) + " NUMA node(s) (";
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(nodes_[i].os_index) + ": " + std::to_string(nodes_[i].cores) + " cores/" +
         std::to_string(nodes_[i].pus.size()) + " PUs";
  }
  return s + "), " + source_ + (can_bind_ ? "" : ", not bound");
}

std::vector<PoolPlan> Topology::plan(int pools, int threads,
                                     const std::vector<int>& numa_nodes) const {
  if (pools < 1) pools = 1;
  if (threads < pools) threads = pools;  // every pool needs a thread
  std::vector<PoolPlan> plan(static_cast<size_t>(pools));
  const int nn = int(nodes_.size());
  for (int p = 0; p < pools; ++p) {
    const int want = p < int(numa_nodes.size()) ? numa_nodes[size_t(p)] : p;
    PoolPlan& pp = plan[size_t(p)];
    pp.requested = want;
    pp.node = -1;
    for (int i = 0; i < nn; ++i)
      if (nodes_[size_t(i)].os_index == want) pp.node = i;
    if (pp.node < 0) {
      pp.node_found = false;
      pp.node = ((want % nn) + nn) % nn;
    }
    pp.node_os = nodes_[size_t(pp.node)].os_index;
  }
  std::vector<int> used(static_cast<size_t>(nn), 0);  // PUs of each node handed out so far
  for (int p = 0; p < pools; ++p) {
    PoolPlan& pp = plan[size_t(p)];
    const int nt = int(int64_t(threads) * (p + 1) / pools - int64_t(threads) * p / pools);
    const auto& pus = nodes_[size_t(pp.node)].pus;
    for (int i = 0; i < nt; ++i)
      pp.pus.push_back(pus[size_t(used[size_t(pp.node)]++) % pus.size()]);
  }
  return plan;
}

}  // namespace ktjit

/* zbccl CPU EP kernels (ep.c), zbk_ep_<kernel>: each takes the address of its typed argument block (zb_ep_<kernel>, then its
 * zb_ep_<kernel>_row per rank where it has per-rank data; zb_abi.h, from abi.EP_ARGS) and returns what its
 * comment in ep.c says (-1 or a count on success, a bad rank or entry otherwise). */
#ifndef ZBCCL_CPU_EP_H
#define ZBCCL_CPU_EP_H
#include "zb_abi.h"

typedef long long i64;

i64 zbk_ep_layout(const void *args);
i64 zbk_ep_route(const void *args);
i64 zbk_ep_plan(const void *args);
i64 zbk_ep_pull(const void *args);
i64 zbk_ep_combine(const void *args);
i64 zbk_ep_ll_plan(const void *args);
i64 zbk_ep_ll_pull(const void *args);
i64 zbk_ep_ll_addrs(const void *args);
i64 zbk_ep_ll_combine(const void *args);
i64 zbk_ep_hosts_recv(const void *args);
i64 zbk_ep_hosts_pack(const void *args);
i64 zbk_ep_hosts_handle(const void *args);
i64 zbk_ep_hosts_ll_recv(const void *args);

#endif

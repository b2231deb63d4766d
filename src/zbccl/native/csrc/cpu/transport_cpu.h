/* zbccl CPU transport: its verb table (transport.c), the one a channel over shared host memory runs on. */
#ifndef ZBCCL_TRANSPORT_CPU_H
#define ZBCCL_TRANSPORT_CPU_H
#include "../core/transport.h"

extern const zb_transport zb_cpu_transport;

#endif

/* zbccl native: CPU relax instruction for spin loops (x86 pause, aarch64 yield). */
#ifndef ZBCCL_ARCH_H
#define ZBCCL_ARCH_H

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() __asm__ __volatile__("" ::: "memory")
#endif

#endif

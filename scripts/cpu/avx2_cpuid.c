/* Make a process see an AVX2 CPU without AVX-512, AVX-VNNI or AMX, at native speed (scripts/cpu/avx2_kernels.sh).

   Libraries pick their kernels from CPUID: onnxruntime's MLAS when it loads, glibc's string functions, llama.cpp's
   CPU backend variant (libggml-cpu-*.so). Loaded with LD_PRELOAD, this makes the CPUID instruction fault for the
   process (arch_prctl ARCH_SET_CPUID, Linux 4.12+ on CPUs with CPUID faulting: `cpuid_fault` in /proc/cpuinfo),
   answers each faulting CPUID itself with the real values less the feature bits below, and steps over it. Threads
   inherit the setting; an exec'd child that inherits LD_PRELOAD loads this again.

   A benchmark and test aid, never shipped in the package: the kernels chosen are those of an AVX2 machine, run on
   this machine's cores, caches and memory (not an AVX2 machine's speed). Another library's SIGSEGV handler set
   through sigaction (Python's faulthandler) is kept and called for every other fault; one set through signal(),
   which glibc routes past this wrapper, would replace this handler (none of the libraries used here does that). */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

static struct sigaction next_handler;  /* whoever else asked for SIGSEGV */
static int (*real_sigaction)(int, const struct sigaction *, struct sigaction *);

static void real_cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
}

static void mask(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    if (leaf == 7 && sub == 0) {
        /* EBX: avx512f, dq, ifma, pf, er, cd, bw, vl */
        r[1] &= ~((1u << 16) | (1u << 17) | (1u << 21) | (1u << 26) | (1u << 27) | (1u << 28) | (1u << 30) | (1u << 31));
        /* ECX: avx512_vbmi, vbmi2, vnni, bitalg, vpopcntdq */
        r[2] &= ~((1u << 1) | (1u << 6) | (1u << 11) | (1u << 12) | (1u << 14));
        /* EDX: avx512_4vnniw, 4fmaps, vp2intersect, amx_bf16, avx512_fp16, amx_tile, amx_int8 */
        r[3] &= ~((1u << 2) | (1u << 3) | (1u << 8) | (1u << 22) | (1u << 23) | (1u << 24) | (1u << 25));
    } else if (leaf == 7 && sub == 1) {
        r[0] = 0;  /* avx_vnni, avx512_bf16, amx_fp16, avx_ifma, ... */
        r[3] = 0;  /* avx_vnni_int8, avx_ne_convert, ... */
    } else if (leaf == 0x1d || leaf == 0x1e) {
        r[0] = r[1] = r[2] = r[3] = 0;  /* AMX tile and TMUL information */
    }
}

static void on_segv(int sig, siginfo_t *info, void *uc_) {
    ucontext_t *uc = uc_;
    greg_t *g = uc->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)g[REG_RIP];
    if (ip[0] == 0x0f && ip[1] == 0xa2) {
        uint32_t r[4], leaf = (uint32_t)g[REG_RAX], sub = (uint32_t)g[REG_RCX];
        real_cpuid(leaf, sub, r);
        mask(leaf, sub, r);
        g[REG_RAX] = r[0], g[REG_RBX] = r[1], g[REG_RCX] = r[2], g[REG_RDX] = r[3];
        g[REG_RIP] += 2;
        return;
    }
    if (next_handler.sa_flags & SA_SIGINFO && next_handler.sa_sigaction) {
        next_handler.sa_sigaction(sig, info, uc_);
        return;
    }
    if (next_handler.sa_handler != SIG_DFL && next_handler.sa_handler != SIG_IGN && next_handler.sa_handler) {
        next_handler.sa_handler(sig);
        return;
    }
    struct sigaction dfl = {0};
    dfl.sa_handler = SIG_DFL;
    real_sigaction(SIGSEGV, &dfl, NULL);  /* a real fault: crash as without this library */
}

int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
    if (!real_sigaction)
        real_sigaction = dlsym(RTLD_NEXT, "sigaction");
    if (sig != SIGSEGV)
        return real_sigaction(sig, act, old);
    if (old)
        *old = next_handler;
    if (act)
        next_handler = *act;
    return 0;
}

__attribute__((constructor)) static void start(void) {
    real_sigaction = dlsym(RTLD_NEXT, "sigaction");
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    real_sigaction(SIGSEGV, &sa, NULL);
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
}

/*
 * kg-exec-stub: the payload of a spare command sandbox.
 *
 *   kg-exec-stub FD
 *
 * Runs inside a sandbox that is already set up (namespaces, mounts, seccomp,
 * cgroup, limits, the agent's uid), so a command can start in it without
 * paying for that set-up.  It reads one request from FD until end of file:
 * NUL-terminated strings
 *
 *   CWD  ARGC  ARGV[0] ... ARGV[ARGC-1]  ENV...      (each ENV is NAME=VALUE)
 *
 * then closes every descriptor above 2, enters CWD, and execs ARGV with
 * exactly ENV, looking ARGV[0] up on that ENV's PATH as bwrap would.  A
 * request that never comes (FD closed empty) exits 0 without running
 * anything.  A bad request or a failed chdir/exec exits 1 with a message on
 * stderr, in bwrap's own words, so both ways of starting a command fail alike.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_REQUEST (8u << 20) /* argv + env; the kernel's own limit is smaller */

extern char **environ;

static void die(const char *what, const char *arg) {
    int saved = errno;
    fprintf(stderr, "bwrap: %s%s%s%s%s\n", what, arg ? " " : "", arg ? arg : "", saved ? ": " : "",
            saved ? strerror(saved) : "");
    _exit(1);
}

int main(int argc, char **argv) {
    if (argc != 2) die("usage: kg-exec-stub FD", NULL);
    char *end;
    long fd = strtol(argv[1], &end, 10);
    if (*argv[1] == '\0' || *end != '\0' || fd < 3) die("not a descriptor:", argv[1]);

    size_t size = 0, capacity = 1 << 16;
    char *data = malloc(capacity);
    if (!data) die("out of memory", NULL);
    for (;;) {
        if (size == capacity) {
            if (capacity >= MAX_REQUEST) die("request too large", NULL);
            capacity *= 2;
            if (!(data = realloc(data, capacity))) die("out of memory", NULL);
        }
        ssize_t n = read((int)fd, data + size, capacity - size);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) die("cannot read the request", NULL);
        if (n == 0) break;
        size += (size_t)n;
    }
    if (size == 0) _exit(0); /* the spare was discarded */
    errno = 0;
    if (data[size - 1] != '\0') die("request not terminated", NULL);

    /* Split into strings. */
    size_t count = 0;
    for (size_t i = 0; i < size; i++) count += data[i] == '\0';
    char **strings = calloc(count + 1, sizeof *strings);
    if (!strings) die("out of memory", NULL);
    for (size_t i = 0, k = 0; i < size; k++) {
        strings[k] = data + i;
        i += strlen(data + i) + 1;
    }
    if (count < 3) die("request too short", NULL);
    const char *cwd = strings[0];
    long nargs = strtol(strings[1], &end, 10);
    if (*strings[1] == '\0' || *end != '\0' || nargs < 1 || (size_t)nargs > count - 2) die("bad argument count", NULL);
    size_t n = (size_t)nargs, nenv = count - 2 - n;
    char **command = calloc(n + 1, sizeof *command);
    char **environment = calloc(nenv + 1, sizeof *environment);
    if (!command || !environment) die("out of memory", NULL);
    memcpy(command, strings + 2, n * sizeof *command);
    memcpy(environment, strings + 2 + n, nenv * sizeof *environment);

    /* The command holds only stdin, stdout and stderr. */
    if (syscall(SYS_close_range, 3u, ~0u, 0u) != 0) {
        for (int other = 3; other < 1024; other++) close(other);
    }
    if (chdir(cwd) != 0) die("Can't chdir to", cwd);
    environ = environment;
    execvp(command[0], command);
    die("execvp", command[0]);
    return 1;
}

/* The benchmark's TCP client, compiled with `cc -O2` when a compiler is present (bench/client.py is
 * the same program in Python).  Two modes, both bounded in count and time, both printing one JSON line:
 *
 *   connect rate ADDR PORT COUNT SECONDS WARMUP
 *       WARMUP then up to COUNT sequential connect()s (stopping after SECONDS); each socket is closed
 *       with an RST (SO_LINGER 0) so that no TIME_WAIT piles up; prints connections/s and connect()
 *       latency percentiles in microseconds.
 *   connect poll ADDR PORT SECONDS ATTEMPT_MS
 *       non-blocking connect attempts, each given ATTEMPT_MS, until one is established or SECONDS
 *       pass; prints the CLOCK_MONOTONIC time of the first success (the rule is in the kernel).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void rst_close(int fd) {
    struct linger lg = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    close(fd);
}

/* One blocking connect() with a 1 s timeout; its duration in seconds, or -1. */
static double one(const struct sockaddr_in *sa) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct timeval tv = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    double t0 = now();
    int rc = connect(fd, (const struct sockaddr *)sa, sizeof *sa);
    double t1 = now();
    rst_close(fd);
    return rc == 0 ? t1 - t0 : -1;
}

static int rate(const struct sockaddr_in *sa, long count, double seconds, long warmup) {
    double *lat = calloc(count > 0 ? count : 1, sizeof *lat);
    long ok = 0, errors = 0, i;
    if (!lat) return 1;
    double warm_end = now() + 1.0;
    for (i = 0; i < warmup && now() < warm_end; i++) one(sa);
    double start = now(), deadline = start + seconds;
    for (i = 0; i < count && now() < deadline; i++) {
        double d = one(sa);
        if (d < 0) errors++;
        else lat[ok++] = d;
    }
    double elapsed = now() - start;
    qsort(lat, ok, sizeof *lat, cmp);
    double p50 = ok ? lat[ok / 2] : 0, p99 = ok ? lat[(long)(ok * 0.99)] : 0, sum = 0;
    for (i = 0; i < ok; i++) sum += lat[i];
    printf("{\"client\": \"c\", \"ok\": %ld, \"errors\": %ld, \"elapsed\": %.6f, \"rate\": %.1f, "
           "\"p50_us\": %.1f, \"p99_us\": %.1f, \"mean_us\": %.1f, \"min_us\": %.1f, \"max_us\": %.1f}\n",
           ok, errors, elapsed, ok / (elapsed > 0 ? elapsed : 1), p50 * 1e6, p99 * 1e6,
           ok ? sum / ok * 1e6 : 0, ok ? lat[0] * 1e6 : 0, ok ? lat[ok - 1] * 1e6 : 0);
    free(lat);
    return ok ? 0 : 1;
}

static int poll_mode(const struct sockaddr_in *sa, double seconds, double attempt_ms) {
    double deadline = now() + seconds;
    long attempts = 0;
    while (now() < deadline) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        if (fd < 0) return 1;
        attempts++;
        int rc = connect(fd, (const struct sockaddr *)sa, sizeof *sa);
        if (rc < 0 && errno == EINPROGRESS) {
            struct pollfd p = {fd, POLLOUT, 0};
            if (poll(&p, 1, (int)attempt_ms) == 1) {
                int err = 0;
                socklen_t len = sizeof err;
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
                rc = err == 0 ? 0 : -1;
                if (rc < 0) usleep((useconds_t)(attempt_ms * 1000));  /* refused/unreachable: pace */
            }
        }
        if (rc == 0) {
            double t = now();
            rst_close(fd);
            printf("{\"client\": \"c\", \"ok\": 1, \"t\": %.6f, \"attempts\": %ld}\n", t, attempts);
            return 0;
        }
        rst_close(fd);
    }
    printf("{\"client\": \"c\", \"ok\": 0, \"attempts\": %ld}\n", attempts);
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s rate|poll ADDR PORT ...\n", argv[0]);
        return 2;
    }
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((unsigned short)atoi(argv[3]));
    if (inet_pton(AF_INET, argv[2], &sa.sin_addr) != 1) {
        fprintf(stderr, "bad address %s\n", argv[2]);
        return 2;
    }
    if (strcmp(argv[1], "rate") == 0 && argc == 7)
        return rate(&sa, atol(argv[4]), atof(argv[5]), atol(argv[6]));
    if (strcmp(argv[1], "poll") == 0 && argc == 6)
        return poll_mode(&sa, atof(argv[4]), atof(argv[5]));
    fprintf(stderr, "usage: %s rate ADDR PORT COUNT SECONDS WARMUP | poll ADDR PORT SECONDS ATTEMPT_MS\n", argv[0]);
    return 2;
}

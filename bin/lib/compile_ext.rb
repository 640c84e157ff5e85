# frozen_string_literal: true

# Compiles NeverBlock's C extensions (ext/neverblock/*: epoll, http_head, monotonic)
# for the Ruby running this file, in a checkout: the tests and benchmarks run
# lib/ from the repository (-Ilib), where no `gem install` built them. Each Ruby gets a
# build directory of its own, tmp/ext/<version>-<platform>[-<prefix>], since
# the 3.4 chroot's Ruby and the YJIT one share a version but not a libruby.
# Rebuilt only when the sources or the Ruby changed (a stamp file); locked,
# since passes of bin/test --jobs may build at once.
#
#   ruby bin/lib/compile_ext.rb      builds if needed, prints the directory to
#                                    put on the load path (RUBYLIB, -I)
#   ruby bin/lib/compile_ext.rb --sanitize
#                                    the same under AddressSanitizer and
#                                    UndefinedBehaviorSanitizer, in tmp/ext-asan/
#                                    (bin/fuzz; see SANITIZE)
#
# From Ruby: `NeverBlockExtension.build` returns that directory. Where the
# extension cannot be built (epoll: not Linux), the directory holds no
# neverblock/<name>.so for it and NeverBlock::Server falls back (a fiber
# per idle connection; llhttp's callbacks for every request head).
require "digest"
require "fileutils"
require "rbconfig"

module NeverBlockExtension
  REPO = File.expand_path("../..", __dir__)
  # One directory per extension, each with its extconf.rb: built into neverblock/<name>.so.
  SOURCES = Dir[File.join(REPO, "ext/neverblock/*/extconf.rb")].map { |extconf| File.dirname(extconf) }.sort

  # The sanitizer build's compiler and linker flags, given to make as
  # ARCH_FLAG: mkmf puts that variable last in CFLAGS and in DLDFLAGS, so its
  # -O1 wins over extconf.rb's -O2 and the shared object links against the
  # runtimes (which a Ruby not built with them must LD_PRELOAD: bin/fuzz).
  # Undefined behaviour aborts, as an ASan error does.
  SANITIZE = "-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1"

  module_function

  # @param sanitize [Boolean] build with {SANITIZE} into tmp/ext-asan/ instead.
  # @return [String] the directory to put on the load path (it holds
  #   neverblock/epoll.so, neverblock/http_head.so and neverblock/monotonic.so once built).
  # @raise [RuntimeError] when the compiler fails (its output in the message).
  def build(sanitize: false)
    dir = File.join(REPO, sanitize ? "tmp/ext-asan" : "tmp/ext", key)
    lib = File.join(dir, "lib")
    stamp = File.join(dir, "stamp")
    FileUtils.mkdir_p(dir)
    File.open(File.join(dir, "lock"), File::RDWR | File::CREAT) do |lock|
      lock.flock(File::LOCK_EX)
      next if File.exist?(stamp) && File.read(stamp) == digest(sanitize)

      started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
      compile(File.join(dir, "build"), lib, sanitize ? ["ARCH_FLAG=#{SANITIZE}"] : [])
      File.write(stamp, digest(sanitize))
      warn format("==> compiled ext/neverblock/{%s} for %s in %.1f s (%s)",
                  SOURCES.map { |source| File.basename(source) }.join(","), RUBY_DESCRIPTION[/\A\S+ \S+/],
                  Process.clock_gettime(Process::CLOCK_MONOTONIC) - started, dir.delete_prefix("#{REPO}/"))
    end
    lib
  end

  # @return [String] e.g. "3.1.2-x86_64-linux-gnu", "3.4.5-x86_64-linux-opt-ruby-3.4-yjit"
  def key
    prefix = RbConfig::CONFIG["prefix"]
    name = "#{RUBY_VERSION}-#{RUBY_PLATFORM}"
    prefix == "/usr" ? name : "#{name}-#{prefix.delete_prefix('/').tr('/', '-')}"
  end

  def digest(sanitize)
    sources = SOURCES.flat_map { |source| Dir[File.join(source, "*.{c,h,rb}")] }.sort
                     .map { |path| [path.delete_prefix(REPO), File.read(path)] }
    Digest::SHA256.hexdigest(Marshal.dump([sources, RbConfig.ruby, RUBY_DESCRIPTION, sanitize && SANITIZE]))
  end

  # @param make_options [Array<String>] variables for make (ARCH_FLAG=...).
  def compile(build, lib, make_options)
    FileUtils.rm_rf([build, lib])
    FileUtils.mkdir_p(File.join(lib, "neverblock"))
    env = { "RUBYOPT" => nil, "RUBYLIB" => nil } # not an outer bundle's: mkmf is the standard library
    SOURCES.each do |source|
      name = File.basename(source)
      dir = File.join(build, name)
      FileUtils.mkdir_p(dir)
      run(env, RbConfig.ruby, File.join(source, "extconf.rb"), chdir: dir)
      run(env, "make", "-j2", *make_options, chdir: dir)
      built = File.join(dir, "#{name}.so")
      next unless File.exist?(built) # extconf.rb built nothing here (epoll: not Linux)

      FileUtils.cp(built, File.join(lib, "neverblock/#{name}.so"))
    end
  end

  def run(env, *command, chdir:)
    output = IO.popen(env, command, chdir: chdir, err: %i[child out], &:read)
    raise "#{command.join(' ')} failed in #{chdir}:\n#{output}" unless $?.success?
  end
end

puts NeverBlockExtension.build(sanitize: ARGV.include?("--sanitize")) if $PROGRAM_NAME == __FILE__

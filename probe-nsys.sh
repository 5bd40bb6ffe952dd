#!/bin/bash
N=$(ls /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys 2>/dev/null | head -1)
echo "nsys: $N"
find /opt/nvidia -name 'QdstrmImporter*' 2>/dev/null
for Q in $(find /opt/nvidia -name 'QdstrmImporter' -type f 2>/dev/null); do
  echo "== $Q"; ls -la $(dirname $Q) | head -40
  echo "-- --version"; timeout 15 $Q --version; echo "rc=$?"
  echo "-- -h"; timeout 15 $Q -h 2>&1 | head -15; echo "rc=$?"
  echo "-- ldd missing"; ldd $Q 2>&1 | grep -i "not found" | head
done
ls $(dirname $N) | head -50
timeout 20 $N --version; echo "nsys rc=$?"
timeout 20 $N status -e 2>&1 | head -20
